"""buckets: {seq: auto}: planned at the start of the run, recorded in the manifest; the
buckets_multiple_of and buckets_max_graphs keys."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main
from graphrun.base.errors import SpecError
from graphrun.plan.planner import histogram, plan
from tests.test_plan import ROOT, small_histogram, write_encoder


def auto_spec(tmp_path, lengths, *, seq="auto", extra=""):
    path = write_encoder(tmp_path, lengths)
    text = path.read_text().replace("  seq: [8, 16]", f"  seq: {seq}")
    path.write_text(text.replace("buckets:\n", f"{extra}buckets:\n"))
    return path


def test_auto_validates_against_the_schema_and_in_graphrun(tmp_path):
    path = auto_spec(tmp_path, [3, 5])
    schema = json.loads((ROOT / "schemas/pipeline.schema.json").read_text())
    jsonschema.validate(yaml.safe_load(path.read_text()), schema)
    assert graphrun.load_spec(path).auto_axes == ["seq"]


def test_run_plans_auto_axes_and_records_the_plan(tmp_path):
    lengths = [3, 5, 2, 7, 20, 4, 4, 4, 9, 1, 12, 30]
    path = auto_spec(tmp_path, lengths, extra="buckets_multiple_of: {seq: 4}\n"
                     "buckets_max_graphs: 4\n")
    manifest = graphrun.run(graphrun.load_spec(path), out=tmp_path / "o")
    assert manifest.status == "completed" and manifest.totals.records_out == len(lengths)
    bp = manifest.bucket_plan
    seq = manifest.spec["buckets"]["seq"]
    assert bp.auto_axes == ["seq"] and bp.buckets == {"seq": seq}
    assert manifest.spec["buckets"]["batch"] == [1, 4]  # the given axis is kept
    assert all(v % 4 == 0 for v in seq) and seq[-1] >= 30 and bp.graphs == 2 * len(seq) <= 4
    assert bp.sample_records == len(lengths)
    # the waste recorded is the planner's on those batches: (4,7) (4,30) (4,30) -> 1 - 113/...
    expected = plan(histogram(graphrun.load_spec(path, [f"buckets.seq={seq}"])), 4, {"seq": 4},
                    {"batch": [1, 4]})
    assert bp.padding_waste == pytest.approx(expected.waste)
    written = json.loads((tmp_path / "o" / "manifest.json").read_text())
    jsonschema.validate(written, json.loads((ROOT / "schemas/manifest.schema.json").read_text()))
    assert written["bucket_plan"]["buckets"] == {"seq": seq}


def test_a_run_without_auto_records_no_plan(write_spec, tmp_path):
    manifest = graphrun.run(graphrun.load_spec(write_spec()), out=tmp_path / "o")
    assert manifest.bucket_plan is None


def test_given_values_must_be_multiples(tmp_path):
    path = auto_spec(tmp_path, [3], seq="[8, 12]", extra="buckets_multiple_of: {seq: 8}\n")
    with pytest.raises(SpecError, match=r"buckets\.seq: values must be multiples of 8"):
        graphrun.load_spec(path)


def test_fixed_lists_over_the_graph_budget_are_one_message(tmp_path):
    path = auto_spec(tmp_path, [3], extra="buckets_max_graphs: 1\n")
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "buckets_max_graphs" in result.output
    assert "Traceback" not in result.output


def test_plan_keeps_fixed_axes_and_covers_an_oversize_batch_by_splitting():
    hist = small_histogram([(8, 5, 3), (8, 13, 2), (3, 30, 1)])
    got = plan(hist, 6, fixed={"batch": [4]})
    assert got.lists == {"batch": [4], "seq": [5, 13, 30]} and got.uncovered == 0
    assert got.padded == 2 * 4 * 5 * 3 + 2 * 4 * 13 * 2 + 4 * 30  # batches of 8 split in two


def test_plan_write_replaces_auto_with_a_flow_list(tmp_path):
    path = auto_spec(tmp_path, [3, 5, 9, 12, 2, 7])
    result = CliRunner().invoke(main, ["plan", str(path), "--max-graphs", "4", "--write"])
    assert result.exit_code == 0, result.output
    assert "  seq: [" in path.read_text() and "seq: auto" not in path.read_text()
    assert "│ spec " not in result.output and "│ planned " in result.output  # no (auto) row


def test_a_runner_built_from_an_auto_spec_says_to_plan_first(tmp_path):
    from graphrun.plan.auto import resolve_auto

    spec = graphrun.load_spec(auto_spec(tmp_path, [3, 5, 9]))
    with pytest.raises(SpecError, match="seq: auto must be planned before a Runner is built"):
        graphrun.Runner(spec)
    with graphrun.Runner(resolve_auto(spec)[0]) as runner:
        out = runner.run_batch({"tokens": [np.arange(3)], "mask": [np.ones(3, np.int64)]})
    assert out["hidden"][0].shape == (3, 8)


def test_auto_plans_from_the_slice_the_run_reads(tmp_path):
    """--start past the file's short records: the plan is made from the slice's own (long)
    records, so none of them is longer than the planned largest value and rejected."""
    from functools import partial

    from graphrun.job.parts import JobParts
    from graphrun.plan.auto import resolve_auto

    lengths = [2] * 8 + [30, 28, 25, 30, 27, 30, 29, 26]
    path = auto_spec(tmp_path, lengths)
    eight = JobParts(plan=partial(resolve_auto, sample=8))  # auto planned from 8 records
    manifest = graphrun.run(graphrun.load_spec(path), out=tmp_path / "o", start=8, parts=eight)
    assert manifest.status == "completed"
    assert (manifest.totals.records_out, manifest.totals.records_rejected) == (8, 0)
    assert manifest.spec["buckets"]["seq"][-1] >= 30
    assert manifest.bucket_plan.sample_records == 8
    # a worker of a job plans from the job's slice, not from its own share
    from graphrun.write.journal import ShardPlace

    share = graphrun.run(graphrun.load_spec(path), out=tmp_path / "w", start=12, stop=16,
                         parts=eight, place=ShardPlace(tmp_path / "w", job_start=8, job_stop=16))
    assert share.spec["buckets"]["seq"] == manifest.spec["buckets"]["seq"]
    assert share.totals.records_out == 4


def test_auto_from_an_empty_slice_names_where_it_read(tmp_path):
    from graphrun.base.errors import InputError

    path = auto_spec(tmp_path, [3, 5, 2])
    with pytest.raises(InputError, match="from record 2"):
        graphrun.run(graphrun.load_spec(path), out=tmp_path / "o", start=2, stop=2)
