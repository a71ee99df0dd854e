"""graphrun plan: the histogram of batch shapes, the exact plan, the table and --write."""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
import yaml

import graphrun
from graphrun.cli.main import main
from graphrun.base.errors import SpecError
from graphrun.plan.planner import Histogram, best_values, evaluate, histogram, plan, power_of_two

ROOT = Path(__file__).resolve().parent.parent

ENCODER_SPEC = """\
# yaml-language-server: $schema=../schemas/pipeline.schema.json
# a comment that --write must keep
version: 1
name: enc
device: cpu
model:
  target: {model}:build
  args: {{vocab: 50, d_model: 8, heads: 2, layers: 1, max_len: 64}}
inputs:
  tokens: {{shape: [batch, seq], dtype: int64, range: [0, 50]}}
  mask: {{shape: [batch, seq], dtype: int64, range: [0, 2], pad: 0}}
outputs:
  hidden: {{shape: [batch, seq, 8]}}
  pooled: {{shape: [batch, 8]}}
buckets:
  batch: [1, 4]   # keep me
  seq: [8, 16]
data:
  path: data.jsonl
  batch_size: 4
output:
  dir: out
  format: jsonl
"""


def write_encoder(tmp_path: Path, lengths: list[int]) -> Path:
    with open(tmp_path / "data.jsonl", "w") as f:
        for i, n in enumerate(lengths):
            f.write(json.dumps({"tokens": [i % 50] * n, "mask": [1] * n}) + "\n")
    spec = tmp_path / "enc.yaml"
    spec.write_text(ENCODER_SPEC.format(model=ROOT / "examples/models/tiny_encoder.py"))
    return spec


def brute_force(needs, weights, k):
    values = sorted(set(needs))
    best = None
    for rest in itertools.combinations(values[:-1], k - 1):
        chosen = sorted(rest) + [values[-1]]
        cost = sum(w * next(c for c in chosen if c >= x) for x, w in zip(needs, weights))
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_best_values_is_exact_against_brute_force(seed):
    rng = random.Random(seed)
    needs = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
    weights = [rng.randint(1, 9) for _ in needs]
    k = rng.randint(1, 6)
    chosen = best_values(np.asarray(needs), np.asarray(weights, float), k)
    assert chosen[-1] == max(needs) and len(chosen) <= k
    cost = sum(w * next(c for c in chosen if c >= x) for x, w in zip(needs, weights))
    assert cost == brute_force(needs, weights, min(k, len(set(needs))))


def small_histogram(rows):
    """rows: (batch, seq, count); real work taken as half the bucket-free volume."""
    needs = np.asarray([r[:2] for r in rows], np.int64)
    count = np.asarray([r[2] for r in rows], np.int64)
    real = needs[:, 0] * needs[:, 1] * count
    return Histogram(("batch", "seq"), needs, count, real, int((needs[:, 0] * count).sum()),
                     int(count.sum()))


def test_two_axis_plan_matches_the_brute_force_over_every_pair_of_lists():
    rng = random.Random(3)
    rows = [(rng.choice([3, 8, 8, 8]), rng.randint(2, 30), rng.randint(1, 5)) for _ in range(25)]
    hist = small_histogram(rows)
    got = plan(hist, 6)
    batches = sorted({r[0] for r in rows})
    seqs = sorted({r[1] for r in rows})
    best = None
    for kb in range(1, len(batches) + 1):
        for ks in range(1, 6 // kb + 1):
            for b in itertools.combinations(batches[:-1], kb - 1):
                for s in itertools.combinations(seqs[:-1], ks - 1):
                    ev = evaluate(hist, {"batch": [*b, batches[-1]], "seq": [*s, seqs[-1]]})
                    best = ev.padded if best is None else min(best, ev.padded)
    assert got.graphs <= 6 and got.padded == best


def test_multiple_of_is_respected_and_still_covers_the_largest():
    hist = small_histogram([(8, 5, 3), (8, 13, 2), (8, 30, 1), (2, 9, 1)])
    got = plan(hist, 4, {"seq": 8})
    assert all(v % 8 == 0 for v in got.lists["seq"]) and got.lists["seq"][-1] >= 30
    assert got.uncovered == 0


def test_rounding_to_a_multiple_stops_at_the_axis_limit():
    """A limit (the model's positions, the truncation length) is never passed: a need rounded
    up past it is planned at the limit itself (the limit need not be a multiple)."""
    from graphrun.plan.auto import covering

    hist = small_histogram([(8, 5, 3), (8, 13, 2), (8, 30, 1)])
    got = plan(covering(hist, {"seq": 30}), 4, {"seq": 7})
    assert got.lists["seq"][-1] == 30 and all(v <= 30 for v in got.lists["seq"])
    capped = plan(covering(hist, {}, {"seq": 30}), 4, {"seq": 16})
    assert max(capped.lists["seq"]) == 30 and capped.uncovered == 0


def test_histogram_counts_every_batch_the_last_included_and_longer_than_the_spec(tmp_path):
    lengths = [3, 5, 2, 7, 20, 4, 4, 4, 9, 1]  # batches of 4: max 7, 20; last batch of 2: max 9
    spec = graphrun.load_spec(write_encoder(tmp_path, lengths))
    hist = histogram(spec)
    shapes = {tuple(n): c for n, c in zip(hist.needs.tolist(), hist.count.tolist())}
    assert shapes == {(4, 7): 1, (4, 20): 1, (2, 9): 1}
    assert hist.records == 10 and hist.batches == 3 and int(hist.real.sum()) == sum(lengths)
    # today's seq list stops at 16: the 20-long batch is not covered by it, the plan covers it
    assert evaluate(hist, spec.buckets).uncovered == 1
    assert plan(hist, 4).lists["seq"][-1] == 20


def test_sample_keeps_whole_batches_of_about_n_records(tmp_path):
    spec = graphrun.load_spec(write_encoder(tmp_path, [1 + i % 16 for i in range(400)]))
    hist = histogram(spec, sample=40)
    assert hist.sampled and hist.batches == 10 and hist.records == 40


def test_encoder_plan_of_8_graphs_wastes_less_than_powers_of_two():
    spec = graphrun.load_spec(ROOT / "pipelines/encoder.yaml")
    hist = histogram(spec)
    planned, pow2 = plan(hist, 8), power_of_two(hist, 8)
    assert planned.graphs <= 8 and pow2.graphs <= 8
    assert planned.uncovered == pow2.uncovered == 0
    assert planned.waste < pow2.waste


def test_cli_prints_the_table_and_the_yaml_and_write_keeps_comments(tmp_path):
    spec = write_encoder(tmp_path, [3, 5, 2, 7, 20, 4, 4, 4, 9, 1, 12, 30])
    before = spec.read_text()
    result = CliRunner().invoke(main, ["plan", str(spec), "--max-graphs", "4"])
    assert result.exit_code == 0, result.output
    for word in ("spec", "power of two", "planned", "padding waste", "buckets:\n  batch: ["):
        assert word in result.output
    assert spec.read_text() == before  # without --write the file is left alone
    result = CliRunner().invoke(main, ["plan", str(spec), "--max-graphs", "4", "--write"])
    assert result.exit_code == 0, result.output
    after = spec.read_text()
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(before.splitlines()) == len(after.splitlines())
    assert [a.split(":")[0] for a, _ in changed] == ["  batch", "  seq"][:len(changed)]
    assert "# keep me" in after and "# a comment that --write must keep" in after
    written = graphrun.load_spec(spec).buckets
    assert written == plan(histogram(graphrun.load_spec(spec)), 4).lists


def test_write_without_ruamel_names_the_extra_and_leaves_the_file(tmp_path, monkeypatch):
    spec = write_encoder(tmp_path, [3, 5, 2, 7])
    before = spec.read_text()
    monkeypatch.setitem(sys.modules, "ruamel.yaml", None)  # import fails as if absent
    result = CliRunner().invoke(main, ["plan", str(spec), "--max-graphs", "4", "--write"])
    assert result.exit_code == 2 and 'pip install -e ".[plan]" in the graphrun clone' in result.output
    assert "Traceback" not in result.output and spec.read_text() == before


def test_cli_bad_multiple_of_is_one_message(tmp_path):
    spec = write_encoder(tmp_path, [3, 5])
    result = CliRunner().invoke(main, ["plan", str(spec), "--multiple-of", "nope=8"])
    assert result.exit_code == 2 and "--multiple-of" in result.output
    assert "Traceback" not in result.output


def test_estimates_scale_the_largest_buckets_cost_by_the_pool(tmp_path):
    from graphrun.plan.planner import Evaluation
    from graphrun.experiments.plan_table import estimates

    spec = graphrun.load_spec(write_encoder(tmp_path, [3, 5]))
    rows = [("a", Evaluation({"batch": [1, 4], "seq": [8, 16]}, 4, 0, 0.0, 0)),
            ("b", Evaluation({"batch": [4], "seq": [16]}, 1, 0, 0.0, 0))]
    measured = []

    def measure(spec, lists):
        measured.append(lists)
        return 0.5, 2 << 20

    assert estimates(spec, rows, measure) == [(2.0, 2.0), (0.5, 2.0)]
    assert len(measured) == 1  # both rows share the largest bucket (4, 16): captured once
    per_graph = spec.model_copy(update={"capture": spec.capture.model_copy(
        update={"pool": "per-graph"})})
    assert estimates(per_graph, rows, measure)[0] == (2.0, 8.0)


@pytest.mark.cuda
def test_plan_on_the_gpu_prints_capture_estimates(tmp_path):
    spec = write_encoder(tmp_path, [3, 5, 9, 12])
    result = CliRunner().invoke(main, ["plan", str(spec), "--max-graphs", "4", "--set",
                                       "device=cuda"])
    assert result.exit_code == 0, result.output
    assert "capture s (est.)" in result.output and "graph MiB (est.)" in result.output


# ---- capture.memory_budget_mib (plan/budget.py) --------------------------------------------------

def test_a_budget_caps_the_batch_values_and_the_plan_fits_it():
    from graphrun.plan.budget import MemoryModel, plan_within

    hist = small_histogram([(32, 10, 6), (32, 40, 3), (32, 64, 1), (5, 20, 1)])
    model = MemoryModel({"batch": 32, "seq": 64}, 32 * 64 * 1000, "a test")  # 1000 B a slot
    free, none = plan_within(hist, 6, {}, {}, None, None)
    assert none is None and free.lists["batch"][-1] == 32
    budget_mib = 16 * 64 * 1000 / 2**20  # a bucket of 16 x 64 slots exactly
    got, note = plan_within(hist, 6, {}, {}, model, budget_mib)
    assert got.lists["batch"][-1] == note.cap == 16 and got.lists["seq"][-1] == 64
    assert model.lists_bytes(got.lists, per_graph=False) <= budget_mib * 2**20
    assert model.lists_bytes(free.lists, per_graph=False) > budget_mib * 2**20
    assert got.uncovered == 0 and got.padded >= free.padded  # split batches: never less work
    assert "batch buckets kept at <= 16" in note.text() and "a test" in note.text()
    per_graph, note = plan_within(hist, 6, {}, {}, model, budget_mib, per_graph=True)
    assert model.lists_bytes(per_graph.lists, per_graph=True) <= budget_mib * 2**20
    assert note.cap < 16


def test_a_budget_below_the_smallest_useful_bucket_says_so():
    from graphrun.plan.budget import MemoryModel, plan_within

    hist = small_histogram([(8, 10, 2), (8, 60, 1)])
    model = MemoryModel({"batch": 8, "seq": 64}, 8 * 64 * 1000, "a test")
    with pytest.raises(SpecError) as err:
        plan_within(hist, 4, {"seq": 8}, {}, model, 0.01, where="enc.yaml")
    msg = str(err.value)
    assert "capture.memory_budget_mib" in msg and "smallest useful bucket" in msg
    assert "batch=1, seq=64" in msg and "raise the budget" in msg


def test_cli_plan_under_a_budget_chooses_smaller_batches_and_says_so(tmp_path):
    rng = random.Random(0)
    spec = write_encoder(tmp_path, [rng.randint(1, 60) for _ in range(200)])
    spec.write_text(spec.read_text().replace("batch_size: 4", "batch_size: 64").replace(
        "batch: [1, 4]", "batch: [1, 4, 64]").replace("seq: [8, 16]", "seq: [8, 16, 64]"))
    free = CliRunner().invoke(main, ["plan", str(spec), "--max-graphs", "6"])
    assert free.exit_code == 0, free.output
    assert "budget" not in free.output
    result = CliRunner().invoke(main, ["plan", str(spec), "--max-graphs", "6", "--set",
                                       "capture.memory_budget_mib=0.5"])
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines()
            if line.startswith("│")}
    assert "OVER" in rows["spec"] and "fits" in rows["planned"]
    assert "batch buckets kept at <=" in result.output and "on the CPU" in result.output
    planned = yaml.safe_load(result.output[result.output.index("buckets:"):])["buckets"]
    assert max(planned["batch"]) < 64
    tiny = CliRunner().invoke(main, ["plan", str(spec), "--set",
                                     "capture.memory_budget_mib=0.001"])
    assert tiny.exit_code != 0 and "smallest useful bucket" in tiny.output
    assert "Traceback" not in tiny.output


def test_auto_buckets_plan_within_the_budget(tmp_path):
    rng = random.Random(1)
    spec = write_encoder(tmp_path, [rng.randint(1, 60) for _ in range(200)])
    spec.write_text(spec.read_text().replace("batch_size: 4", "batch_size: 64").replace(
        "batch: [1, 4]   # keep me", "batch: auto").replace("seq: [8, 16]", "seq: auto"))
    m = graphrun.run(graphrun.load_spec(spec, ["capture.memory_budget_mib=0.5"]),
                     out=tmp_path / "o")
    free = graphrun.run(graphrun.load_spec(spec), out=tmp_path / "free")
    assert m.status == "completed" and m.totals.records_out == 200
    assert max(m.spec["buckets"]["batch"]) < max(free.spec["buckets"]["batch"]) == 64
    assert "batch buckets kept at <=" in m.bucket_plan.memory_budget
    assert free.bucket_plan.memory_budget is None


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="needs transformers and tokenizers")
@pytest.mark.parametrize("truncate", [True, False])
def test_plan_never_passes_the_models_positions_or_the_truncation_length(tmp_path, truncate):
    from tests.test_init_hf import LIMIT, save_model, write_texts

    folder = save_model(tmp_path / "bert", "embed")  # 32 positions
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["model_max_length"] = 1000  # the tokenizer says more than the model holds
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    write_texts(tmp_path / "texts.jsonl", n=40, longest=45)
    spec = tmp_path / "s.yaml"
    result = CliRunner().invoke(main, ["init", "--hf", str(folder), "--data",
                                       str(tmp_path / "texts.jsonl"), "-o", str(spec),
                                       "--sample", "16", "--batch-size", "4",
                                       "--out-dir", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    text = spec.read_text()
    seq_line = next(line for line in text.splitlines() if line.startswith("  seq:"))
    assert seq_line.endswith("the last: the model's limit")  # init's comment, kept
    text = text.replace(seq_line, re.sub(r"\[[^\]]*\]", "[8, 16]", seq_line))
    text = text.replace("truncate: true", f"truncate: {str(truncate).lower()}")
    spec.write_text(text)
    result = CliRunner().invoke(main, ["plan", str(spec), "--max-graphs", "4", "--write"])
    assert result.exit_code == 0, result.output
    top = 16 if truncate else LIMIT  # cut at the spec's 16; else up to the model's 32
    assert ("too long" in result.output) is not truncate
    assert f"seq stops at {top}" in result.output
    written = graphrun.load_spec(spec)
    assert max(written.buckets["seq"]) <= top
    after = spec.read_text()
    graphs = len(written.buckets["batch"]) * len(written.buckets["seq"])
    assert f"one graph per combination: {graphs}" in after
    assert "the model's limit" not in after
    if truncate:
        assert written.buckets["seq"][-1] == 16
        assert "the last, 16, is the spec's truncation length" in after
    written.data.on_bad_record = "skip"
    assert graphrun.run(written).status == "completed"


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="needs transformers and tokenizers")
def test_validate_refuses_a_seq_bucket_past_the_models_positions(tmp_path):
    from tests.test_init_hf import LIMIT, save_model, write_texts

    folder = save_model(tmp_path / "bert", "embed")
    write_texts(tmp_path / "texts.jsonl", n=8)
    spec = tmp_path / "s.yaml"
    result = CliRunner().invoke(main, ["init", "--hf", str(folder), "--data",
                                       str(tmp_path / "texts.jsonl"), "-o", str(spec)])
    assert result.exit_code == 0, result.output
    with pytest.raises(SpecError, match=rf"buckets.seq: {2 * LIMIT} is past the model's "
                       rf"{LIMIT} positions \(config.json's max_position_embeddings\)"):
        graphrun.load_spec(spec, [f"buckets.seq=[8, {2 * LIMIT}]"])
