"""capture.lazy, the default: a run sets up the buckets its batches select, each when first
needed, reports when (set up at start, on first use, never), and accounts a first use as its
own phase; a first use that fails stops the run naming the bucket and the batch, with the
batches before it committed. The measuring commands set up every bucket."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main
from graphrun.base.phases import FIRST_USE
from graphrun.job.progress import bucket_setup
from graphrun.spec.keys import PipelineSpec


@pytest.fixture(autouse=True)
def reads_no_further_than_it_must(monkeypatch):
    """These tests set buckets up on first use: a reader that held the whole file by setup
    (GRAPHRUN_READ_AHEAD_BYTES, on by default with 6 or more cores) would set them all up at
    start, as the run should, and leave no first use to test."""
    monkeypatch.setenv("GRAPHRUN_READ_AHEAD_BYTES", "0")


# A linear scorer that differs from itself at batch size 1 while the file "flaky" sits beside
# it: bucket batch=1 fails verification wherever it is set up, the others pass.
FLAKY = '''\
from pathlib import Path

import torch

FLAG = Path(__file__).with_name("flaky")


class Scorer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        y = self.lin(x)
        if FLAG.exists() and x.shape[0] == 1:
            y = y + torch.rand_like(y)
        return y


def build():
    return Scorer()
'''


def flaky_job(tmp_path, records: int = 49, **capture) -> PipelineSpec:
    """records rows in batches of 8 into buckets [1, 8, 64]: with 49, batches 0-5 hold 8 and
    batch 6 holds 1, past the reader's look-ahead (4 batches): bucket 1's first use. Eager
    buckets are checked (capture.verify.eager), as captured ones are on a GPU."""
    (tmp_path / "model.py").write_text(FLAKY)
    (tmp_path / "flaky").write_text("")
    rng = np.random.default_rng(0)
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"id": f"r{i}", "x": rng.standard_normal(4).round(3).tolist()}) + "\n"
        for i in range(records)))
    spec = {"version": 1, "name": "lazy", "device": "cpu", "model": {"target": "model.py:build"},
            "inputs": {"x": {"shape": ["batch", 4]}}, "outputs": {"y": {"shape": ["batch", 3]}},
            "buckets": {"batch": [1, 8, 64]}, "capture": {"warmup_iters": 1, "verify": {"eager": True}, **capture},
            "data": {"path": "data.jsonl", "id_field": "id", "batch_size": 8},
            "output": {"dir": "out", "format": "npy", "rows_per_file": 16}}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def written(out) -> tuple[list, np.ndarray]:
    ids = [i for p in sorted(out.glob("part-*.ids.npy")) for i in np.load(p).tolist()]
    y = np.concatenate([np.load(p) for p in sorted(out.glob("part-*.y.npy"))])
    return ids, y


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# ---- what a run sets up, and how it says so --------------------------------------------------

def test_a_run_sets_up_at_start_only_what_its_batches_select_and_says_so(tmp_path):
    """The default (no capture key): batches 8 x 6, then 1; bucket 64 is never set up, bucket 1
    on its first use, in a phase of its own that the stream's time does not hold."""
    spec = flaky_job(tmp_path)
    (tmp_path / "flaky").unlink()
    result = cli("run", spec)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert re.search(r"buckets: 1 set up at start, 1 on first use \(batch=1 by batch 6; "
                     r"\d+\.\d\d s\), 1 never set up \(no batch selected them: "
                     r"capture\.lazy\)", said), said
    assert "set up batch=1 (on first use by batch 6, eager)" in said
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    b = {x["name"]: x for x in m["buckets"]}
    assert [b[n]["set_up"] for n in ("batch=1", "batch=8", "batch=64")] == [
        "first_use", "setup", None]
    assert (b["batch=64"]["status"], b["batch=64"]["warmup_s"]) == ("unused", None)
    assert b["batch=1"]["first_use_batch"] == 6 and b["batch=1"]["batches"] == 1
    top = {p["name"]: p["s"] for p in m["phases"]["top"]}
    parts = {x["bucket"]: x for x in m["phases"]["buckets"]}
    assert set(parts) == {"batch=1", "batch=8"}
    assert parts["batch=1"]["within"] == FIRST_USE and parts["batch=8"]["within"] is None
    first = parts["batch=1"]
    assert 0 < first["warmup_s"] + first["verify_s"] <= top[FIRST_USE]
    assert top["warm-up"] == pytest.approx(parts["batch=8"]["warmup_s"])  # at start only
    assert sum(top.values()) == pytest.approx(m["totals"]["process_wall_s"], rel=1e-9)
    # the first use's set-up is a phase beside the stream's, not counted in both
    assert top["stream"] + top[FIRST_USE] <= m["totals"]["stream_s"] + 0.01


def test_lazy_false_sets_every_bucket_up_at_start(tmp_path):
    spec = flaky_job(tmp_path, lazy=False)
    (tmp_path / "flaky").unlink()
    manifest = graphrun.run(graphrun.load_spec(spec), out=tmp_path / "o")
    assert {(b.set_up, b.status) for b in manifest.buckets} == {("setup", "eager")}
    assert bucket_setup(manifest) == "buckets: 3 set up at start"
    assert all(p.within is None for p in manifest.phases.buckets)
    assert FIRST_USE not in {p.name for p in manifest.phases.top}


def test_the_eager_baseline_of_a_bucket_set_up_on_first_use_is_measured_then(tmp_path):
    spec = graphrun.load_spec(flaky_job(tmp_path), ["report.baseline=eager"])
    (tmp_path / "flaky").unlink()
    b = {x.name: x for x in graphrun.run(spec, out=tmp_path / "o").buckets}
    assert b["batch=1"].set_up == "first_use" and b["batch=1"].eager_us > 0
    assert b["batch=8"].eager_us > 0 and b["batch=64"].eager_us is None


def test_the_python_api_runner_sets_each_bucket_up_on_its_first_batch(tmp_path):
    spec = graphrun.load_spec(flaky_job(tmp_path))
    (tmp_path / "flaky").unlink()
    with graphrun.Runner(spec) as runner:
        assert {s.status for s in runner.states.values()} == {"unused"}
        runner.run_batch({"x": np.ones((5, 4), np.float32)})
        runner.run_batch({"x": np.ones((1, 4), np.float32)})
        got = {r.name: (r.set_up, r.first_use_batch, r.status) for r in runner.bucket_reports()}
    assert got == {"batch=1": ("first_use", 1, "eager"), "batch=8": ("first_use", 0, "eager"),
                   "batch=64": (None, None, "unused")}


# ---- a first use that fails ------------------------------------------------------------------

def test_a_bucket_failing_verification_on_first_use_stops_the_run_and_resume_completes(
        tmp_path):
    spec = flaky_job(tmp_path)
    result = cli("run", spec, "-q")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    said = " ".join(result.output.split())
    assert said.startswith("error: bucket batch=1: its setup on first use, for batch 6 of "
                           "this run (capture.lazy), failed: verification failed: "), said
    assert "replay differs from eager" in said and "1. make forward deterministic" in said
    assert "the run's batches before it are committed: after a fix, graphrun run --resume" \
        in said
    out = tmp_path / "out"
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "failed" and m["error"].startswith("bucket batch=1: its setup")
    one = {b["name"]: b for b in m["buckets"]}["batch=1"]
    assert (one["set_up"], one["first_use_batch"], one["batches"]) == ("first_use", 6, 0)
    assert "its setup on first use (batch 6) failed" in one["reason"]
    assert FIRST_USE in {p["name"] for p in m["phases"]["top"]}
    ids, _ = written(out)
    assert ids == [f"r{i}" for i in range(48)]  # every batch before it, committed
    (tmp_path / "flaky").unlink()  # the model fixed
    result = cli("run", spec, "-q", "--resume")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["status"] == "completed"
    ids, y = written(out)
    clean = graphrun.run(graphrun.load_spec(spec, ["capture.lazy=false"]), out=tmp_path / "c")
    assert clean.status == "completed" and ids == [f"r{i}" for i in range(49)]
    np.testing.assert_array_equal(y, written(tmp_path / "c")[1])


@pytest.mark.parametrize("overlap", [False, True])
def test_a_first_use_failure_keeps_the_batches_before_it_on_either_path(tmp_path, overlap):
    spec = graphrun.load_spec(flaky_job(tmp_path))
    with pytest.raises(graphrun.CaptureError, match=r"bucket batch=1: its setup on first use, "
                                                    r"for batch 6 of this run"):
        graphrun.run(spec, out=tmp_path / "o", overlap=overlap)
    assert written(tmp_path / "o")[0] == [f"r{i}" for i in range(48)]


def test_the_python_api_names_the_bucket_and_the_batch_and_keeps_lazy_false_failing_early(
        tmp_path):
    spec = graphrun.load_spec(flaky_job(tmp_path))
    with graphrun.Runner(spec) as runner:
        runner.run_batch({"x": np.ones((8, 4), np.float32)})
        with pytest.raises(graphrun.CaptureError, match=r"bucket batch=1: its setup on first "
                                                        r"use, for batch 1 of this run"):
            runner.run_batch({"x": np.ones((1, 4), np.float32)})
    with pytest.raises(graphrun.CaptureError, match=r"^bucket batch=1: verification failed"):
        graphrun.Runner(graphrun.load_spec(flaky_job(tmp_path), ["capture.lazy=false"]))


# ---- buckets: auto and the model's limit -----------------------------------------------------

@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.test_init_hf import save_model

    return save_model(tmp_path_factory.mktemp("bert"), "embed")


def text_spec(tmp_path, folder, texts: list[str], lazy: bool) -> PipelineSpec:
    tmp_path.mkdir()
    (tmp_path / "texts.jsonl").write_text("".join(
        json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    from tests.test_init_hf import SPECIALS, WORDS

    ints = {"dtype": "int64", "range": [0, 2], "shape": ["batch", "seq"], "pad": 0}
    return PipelineSpec.model_validate({
        "version": 1, "name": "texts", "device": "cpu",
        "model": {"hf": {"path": str(folder), "class": "AutoModel"}},
        "inputs": {"input_ids": {**ints, "range": [0, len(SPECIALS) + len(WORDS)]},
                   "attention_mask": ints, "token_type_ids": ints},
        "outputs": {"embedding": {"shape": ["batch", 16], "from": "last_hidden_state",
                                  "reduce": ["mean_pool"]}},
        "buckets": {"batch": [4], "seq": "auto"}, "capture": {"lazy": lazy},
        "data": {"path": str(tmp_path / "texts.jsonl"), "id_field": "id", "batch_size": 4,
                 "text": {"field": "text", "truncate": True}},
        "output": {"dir": str(tmp_path / "out"), "format": "npy"}})


def test_seq_auto_sets_up_the_models_limit_only_when_a_batch_needs_it(tmp_path, bert):
    """The plan (from the first 8 texts, all short) ends at the tokenizer's limit for longer
    texts later in the file: not set up while none comes; set up on first use by the batch
    that holds one, with the outputs of a run that set every bucket up at start."""
    from functools import partial

    from graphrun.job.parts import JobParts
    from graphrun.plan.auto import resolve_auto
    from tests.test_init_hf import LIMIT

    eight = JobParts(plan=partial(resolve_auto, sample=8))  # auto planned from 8 records
    short = ["the cat sat", "a dog ran on the mat", "big red bird"] * 8  # 24: batches 0-5
    long = " ".join(["the quick small cat and then the slow big dog"] * 4)  # past the limit
    limit = f"batch=4,seq={LIMIT}"
    manifest = graphrun.run(text_spec(tmp_path / "a", bert, short, True),
                            out=tmp_path / "a" / "o", parts=eight)
    b = {x.name: x for x in manifest.buckets}
    assert manifest.spec["buckets"]["seq"][-1] == LIMIT and len(b) >= 2
    assert (b[limit].status, b[limit].set_up, b[limit].capture_s) == ("unused", None, None)
    assert all(x.set_up == "setup" for n, x in b.items() if n != limit)
    texts = short + [long, "a cat"]
    got = graphrun.run(text_spec(tmp_path / "b", bert, texts, True), out=tmp_path / "b" / "o",
                       parts=eight)
    want = graphrun.run(text_spec(tmp_path / "c", bert, texts, False), out=tmp_path / "c" / "o",
                        parts=eight)
    b = {x.name: x for x in got.buckets}
    assert (b[limit].set_up, b[limit].first_use_batch, b[limit].batches) == ("first_use", 6, 1)
    assert {x.set_up for x in want.buckets} == {"setup"}
    np.testing.assert_allclose(written_npy(tmp_path / "b" / "o"),
                               written_npy(tmp_path / "c" / "o"), rtol=1e-5, atol=1e-6)


def test_a_grouped_run_sets_up_what_its_first_window_selects_at_start(tmp_path, bert):
    """data.group_by_length: the first window's batches come out together, shortest first;
    the reader holds all of them before the stream, so the longer buckets that window selects
    are set up at start too, not mid-stream."""
    from tests.test_init_hf import LIMIT

    short, medium = "a cat", "the big red cat sat on the mat under a tree"
    long = " ".join(["the quick small cat and then the slow big dog"] * 2)
    texts = [short, medium, short, long] * 10  # 40: one window of 40, batches of 4
    spec = text_spec(tmp_path / "g", bert, texts, True).model_copy(deep=True)
    spec.buckets["seq"] = [8, 16, LIMIT]
    spec.data.group_by_length = 40
    manifest = graphrun.run(spec, out=tmp_path / "g" / "o")
    used = {b.name: b.set_up for b in manifest.buckets if b.batches}
    assert used == {"batch=4,seq=8": "setup", "batch=4,seq=16": "setup",
                    f"batch=4,seq={LIMIT}": "setup"}


def written_npy(out) -> np.ndarray:
    return np.concatenate([np.load(p) for p in sorted(out.glob("part-*.embedding.npy"))])


# ---- the measuring commands ------------------------------------------------------------------

def test_bench_sets_every_bucket_up_before_it_times_one(tmp_path):
    from graphrun.experiments import bench

    spec = graphrun.load_spec(flaky_job(tmp_path))  # capture.lazy: true, the default
    (tmp_path / "flaky").unlink()
    seen, timed = [], bench.time_steps

    def time_steps(step, *args):
        seen.append({s.set_up for s in step.__self__.states.values()})
        return timed(step, *args)

    result = bench.bench(spec, iters=2, warmup=1, distinct=1, repeats=1, log=lambda m: None,
                         time_steps=time_steps)
    assert [b.name for b in result.buckets] == ["batch=1", "batch=8", "batch=64"]
    assert seen == [{"setup"}] * 3


def test_sweep_sets_every_bucket_up_unless_told(tmp_path):
    from graphrun.experiments.sweep import every_bucket

    assert every_bucket(["data.oversize=error"], {"data.batch_size": [2, 4]}) == [
        "capture.lazy=false", "data.oversize=error"]
    assert every_bucket(["capture.lazy = true"], {}) == ["capture.lazy = true"]
    assert every_bucket([], {"capture.lazy": [True, False]}) == []
    spec = graphrun.load_spec(flaky_job(tmp_path), every_bucket([], {}))
    assert spec.capture.lazy is False


# ---- on the GPU (marked cuda; skipped without one) -------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.cuda
@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_a_default_run_captures_what_its_batches_select(tmp_path, overlap):
    """decoder-step's 1,996 records in batches of 32: bucket 32 captured at start, 16 by the
    last batch (62), the others never; the eager baseline measured on first use too; the
    outputs those of a run that captured every bucket at start."""
    path, sets = ROOT / "pipelines" / "decoder-step.yaml", ["report.baseline=eager"]
    m = graphrun.run(graphrun.load_spec(path, sets), out=tmp_path / "lazy", overlap=overlap)
    every = graphrun.run(graphrun.load_spec(path, [*sets, "capture.lazy=false"]),
                         out=tmp_path / "all", overlap=overlap)
    b = {x.name: x for x in m.buckets}
    assert (b["batch=32"].set_up, b["batch=16"].set_up, b["batch=16"].first_use_batch) == (
        "setup", "first_use", 62)
    for x in (b["batch=32"], b["batch=16"]):
        assert x.status == "captured" and x.speedup and x.speedup > 0 and x.batches
        assert len(x.lanes) == (2 if overlap else 1) and all(v.verify.passed for v in x.lanes)
    for name in ("batch=8", "batch=4", "batch=2", "batch=1"):
        assert (b[name].status, b[name].capture_s, b[name].lanes) == ("unused", None, [])
    assert {x.set_up for x in every.buckets} == {"setup"}
    assert m.totals.capture_s < every.totals.capture_s
    assert {p.bucket for p in m.phases.buckets if p.within == FIRST_USE} == {"batch=16"}
    for name in ("ids", "logits"):
        got, want = (np.concatenate([np.load(p, allow_pickle=True)
                                   for p in sorted(d.glob(f"part-*.{name}.npy"))])
                     for d in (tmp_path / "lazy", tmp_path / "all"))
        np.testing.assert_array_equal(got, want)


SYNCS_AT_ONE = FLAKY.replace(
    "if FLAG.exists() and x.shape[0] == 1:\n            y = y + torch.rand_like(y)",
    "if FLAG.exists() and x.shape[0] == 1:\n            y = y / (1 + x.abs().max().item())")


@pytest.mark.cuda
@pytest.mark.parametrize("on_failure", ["error", "eager"])
def test_gpu_a_capture_failing_on_first_use_stops_or_runs_that_bucket_eagerly(tmp_path,
                                                                             on_failure):
    """A host sync at batch size 1 only: bucket 1's capture fails when batch 6 first needs
    it. error: the run stops naming the bucket and the batch, 48 records committed; eager:
    the bucket runs eagerly and the run completes."""
    spec = flaky_job(tmp_path, on_failure=on_failure)
    (tmp_path / "model.py").write_text(SYNCS_AT_ONE)
    spec = graphrun.load_spec(spec, ["device=cuda"])
    if on_failure == "error":
        with pytest.raises(graphrun.CaptureError, match=r"bucket batch=1: its setup on first "
                                                        r"use, for batch 6 of this run"):
            graphrun.run(spec, out=tmp_path / "o")
        assert written(tmp_path / "o")[0] == [f"r{i}" for i in range(48)]
        return
    m = graphrun.run(spec, out=tmp_path / "o")
    one = {x.name: x for x in m.buckets}["batch=1"]
    assert m.status == "completed" and (one.status, one.set_up, one.batches) == (
        "eager", "first_use", 1)
    assert "CUDA graph capture failed" in one.reason
    assert written(tmp_path / "o")[0] == [f"r{i}" for i in range(49)]


def test_a_bucket_one_worker_left_unused_is_reported_as_set_up(tmp_path):
    """capture.lazy: worker 0 never needed batch=1, worker 1 set it up on first use; the job's
    manifest says what worker 1 saw, with both workers' counts."""
    from types import SimpleNamespace

    from graphrun.manifest.keys import BucketReport
    from graphrun.scale.local.merge import merge_buckets

    def worker(status, set_up, batches):
        b = BucketReport(name="batch=1", sizes={"batch": 1}, status=status, set_up=set_up,
                         first_use_batch=3 if set_up else None, batches=batches,
                         records=batches, reason=None if set_up else "capture.lazy: unused")
        return SimpleNamespace(buckets=[b], totals=SimpleNamespace(batches=0))

    got = merge_buckets(tmp_path, [worker("unused", None, 0), worker("captured", "first_use", 2),
                                   worker("unused", None, 0)], [50])
    assert [(b.status, b.set_up, b.first_use_batch, b.batches, b.reason) for b in got] == [
        ("captured", "first_use", 3, 2, None)]
