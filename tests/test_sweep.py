"""graphrun sweep: every combination of the grid runs in its own process; a failing variant is
a row; sweep.json validates against schemas/sweep.schema.json; the Pareto front is marked."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from click.testing import CliRunner

from graphrun.cli.main import main
from graphrun.experiments.sweep import SCHEMA, Variant, mark_pareto, parse_grid, schema_text, variants


def test_the_checked_in_schema_is_current():
    assert SCHEMA.read_text() == schema_text(), (
        "stale: python3 -c 'from graphrun.experiments.sweep import *; SCHEMA.write_text(schema_text())'")


def test_grid_parses_yaml_lists_and_rejects_anything_else():
    grid = parse_grid(("capture.warmup_iters=[1, 3]", "buckets.batch=[[1,2],[4]]"))
    assert grid == {"capture.warmup_iters": [1, 3], "buckets.batch": [[1, 2], [4]]}
    assert [o for _, o in variants(grid)][1] == {"capture.warmup_iters": 1,
                                                 "buckets.batch": [4]}
    for bad in ("capture.warmup_iters=3", "x=[]", "=[1]", "k=[1"):
        with pytest.raises(Exception, match="--grid"):
            parse_grid((bad,))


def test_pareto_front_is_the_non_dominated_variants():
    def v(name, rate, mem):
        return Variant(name=name, overrides={}, status="completed", records_per_s=rate,
                       memory_bytes=mem)

    rows = [v("a", 100, 10), v("b", 200, 30), v("c", 150, 40), v("d", 50, 5),
            Variant(name="e", overrides={}, status="failed", error="x")]
    mark_pareto(rows)
    assert [r.name for r in rows if r.pareto] == ["a", "b", "d"]


@pytest.mark.slow
def test_sweep_runs_each_variant_and_keeps_going_after_failures(write_spec, tmp_path):
    spec = write_spec()
    (tmp_path / "bad.jsonl").write_text('{"x": [1, 2, 3, 4]}\n{"x": [1, 2]}\n')
    out = tmp_path / "sw"
    # batch_size 8 > the largest batch bucket (4) with oversize: error is an invalid variant;
    # a record of the wrong shape fails in the variant's own run (a child process)
    result = CliRunner().invoke(main, [
        "sweep", str(spec), "--grid", "data.batch_size=[2,4,8]", "--grid",
        "data.path=[data.jsonl, bad.jsonl]", "--set", "data.oversize=error", "--stop", "6",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "sweep.json").read_text())
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    rows = doc["variants"]
    assert [r["status"] for r in rows] == ["completed", "failed"] * 2 + ["failed"] * 2
    assert "bad.jsonl:2" in rows[1]["error"] and "must be 4" in rows[1]["error"]
    assert "larger than the largest batch bucket" in rows[4]["error"]
    for r in (rows[0], rows[2]):
        manifest = json.loads((out / r["name"] / "manifest.json").read_text())
        assert manifest["totals"]["records_out"] == 6  # --stop 6
        assert manifest["spec"]["data"]["batch_size"] == r["overrides"]["data.batch_size"]
        # every bucket's capture and memory, not only those 6 records select (capture.lazy)
        assert [b["set_up"] for b in manifest["buckets"]] == ["setup"] * 3
        # the CPU captures nothing, so nothing is verified
        assert r["verify"] == ("passed" if torch.cuda.is_available() else "off")
        assert r["records_per_s"] > 0
    assert rows[0]["outputs_equal_first"] is None and rows[2]["outputs_equal_first"] is True
    # batches of 2 into buckets [1, 2, 4] pad nothing; 6 records as 4 + 2 pad nothing either
    assert rows[0]["padding_waste"] == 0 and rows[2]["padding_waste"] == 0
    assert any(r["pareto"] for r in rows) and not any(r["pareto"] for r in rows[4:])
    assert result.output.count("failed") >= 4 and "records/s" in result.output


def test_a_generation_sweep_shows_output_tokens_per_s_and_tells_completions_apart(tmp_path):
    from tests.test_generate_job import write_spec as write_generation_spec

    spec = write_generation_spec(tmp_path, n=4, data__group_by_length=None,
                                 buckets={"batch": [1, 2], "seq": [8, 16]},
                                 generate={"max_new_tokens": 2, "min_new_tokens": 2,
                                           "sampling": {"method": "greedy"}})
    out = tmp_path / "sw"
    result = CliRunner().invoke(main, [
        "sweep", str(spec), "--grid", "generate.max_new_tokens=[2,3]", "--grid",
        "data.batch_size=[1,2]", "--set", "generate.min_new_tokens=0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "sweep.json").read_text())
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    rows = doc["variants"]
    assert [r["status"] for r in rows] == ["completed"] * 4, result.output
    for r in rows:
        gen = json.loads((out / r["name"] / "manifest.json").read_text())["generation"]
        assert r["output_tokens_per_s"] == gen["output_tokens_per_s"] > 0
    # the same completions at another batch size; longer ones are not the first's
    assert [r["outputs_equal_first"] for r in rows] == [None, True, False, False]
    assert "tokens/s" in result.output and "output tokens/s" in result.output
