"""Setup cut to the model's work (issue 23): one eager reference per bucket, capture.lazy, and
weights loaded into parameters made on the meta device. All on the CPU (eager backend), which
runs the same setup code as the GPU, less the capture itself."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import graphrun
from graphrun import CaptureError, Runner
from graphrun.engine.buckets import BucketTable
from graphrun.engine.lazy import batch_needs, shape_needs
from graphrun.models.load import build_model
from graphrun.spec.keys import PipelineSpec

from tests.spec_keys import with_keys

COUNTED = """
import torch
CALLS = []
class Counted(torch.nn.Module):
    def __init__(self, noise=0.0):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.noise = noise
        CALLS.append(("init", self.lin.weight.device.type))
    def forward(self, x):
        CALLS.append(("call", x.shape[0]))
        y = self.lin(x)
        return y + self.noise * torch.rand_like(y) if self.noise else y
def build(noise=0.0):
    torch.manual_seed(0)
    return Counted(noise)
"""


@pytest.fixture(autouse=True)
def reads_no_further_than_it_must(monkeypatch):
    """These tests set buckets up on first use: a reader that held the whole file by setup
    (GRAPHRUN_READ_AHEAD_BYTES, on by default with 6 or more cores) would set them all up at
    start, as the run should, and leave no first use to test."""
    monkeypatch.setenv("GRAPHRUN_READ_AHEAD_BYTES", "0")


def make_spec(tmp_path, *, records: int = 19, batch_size: int = 8, **over) -> PipelineSpec:
    """Rows of 4 floats in an .npy file; buckets [1, 8, 64, 128] unless overridden."""
    x = np.random.default_rng(0).standard_normal((records, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    raw = {"version": 1, "name": "cuts", "device": "cpu",
           "model": {"builtin": "mlp",
                     "args": {"in_features": 4, "hidden": 16, "layers": 2, "out_features": 3}},
           "inputs": {"x": {"shape": ["batch", 4]}},
           "outputs": {"y": {"shape": ["batch", 3]}},
           "buckets": {"batch": [1, 8, 64, 128]},
           "data": {"path": str(tmp_path / "x.npy"), "batch_size": batch_size},
           "output": {"dir": str(tmp_path / "o"), "format": "npy"}}
    return PipelineSpec.model_validate(with_keys(raw, over))


def counted_spec(tmp_path, **over) -> PipelineSpec:
    (tmp_path / "counted.py").write_text(COUNTED)
    over = {"model": {"target": f"{tmp_path / 'counted.py'}:build"}, **over}
    return make_spec(tmp_path, buckets={"batch": [1, 2, 4]}, **over)


def calls_of(model) -> list:
    return sys.modules[type(model).__module__].CALLS


# ---- verification: one eager reference per bucket -------------------------------------------

def test_a_bucket_costs_one_eager_reference_and_the_lanes_runs_not_a_second_eager_run(tmp_path):
    """Setup's model calls on the eager backend: the layout's probe, then per bucket its
    warm-up on the verification batch (the eager reference), the lane's run compared with it,
    and (batch > 1) the run with other padded rows. Before: one eager run more per bucket."""
    spec = counted_spec(tmp_path, capture={"lazy": False, "verify": {"eager": True}})
    with Runner(spec) as runner:
        calls = [c for c in calls_of(runner.model) if c[0] == "call"]
        assert [n for _, n in calls] == [1, 4, 4, 4, 2, 2, 2, 1, 1]  # was 12 calls
        for state in runner.states.values():
            verify = runner.lanes[0].graphs[state.bucket].verify
            assert verify.passed and verify.pad_isolated is (None if state.bucket.batch == 1
                                                             else True)
            assert state.reference is None  # no second lane on the eager backend: let go


@pytest.mark.parametrize("verify", [{}, {"enabled": False}, {"enabled": False, "eager": True}])
def test_an_eager_bucket_costs_no_run_at_setup_and_says_why(tmp_path, verify):
    """Nothing is captured, so nothing is warmed up or checked: the first call (the layout's
    probe) is setup's only one, unless capture.verify.eager asks for the model's checks."""
    spec = counted_spec(tmp_path, capture={"verify": verify, "lazy": False})
    with Runner(spec) as runner:
        assert [c[1] for c in calls_of(runner.model) if c[0] == "call"] == [1]
        for report in runner.bucket_reports():
            assert (report.status, report.set_up, report.warmup_s) == ("eager", "setup", None)
            assert [lane.verify for lane in report.lanes] == [None]
            assert "no warm-up and no replay-vs-eager check" in report.reason


def test_a_model_that_differs_from_itself_still_fails_verification(tmp_path):
    """The lane's run is compared with the reference taken by the warm-up: a model whose
    outputs change from call to call is caught, as when eager ran again for the check."""
    spec = counted_spec(tmp_path, model={"target": f"{tmp_path / 'counted.py'}:build",
                                         "args": {"noise": 1.0}},
                        capture={"lazy": False, "verify": {"eager": True}})
    with pytest.raises(CaptureError, match="replay differs from eager"):
        Runner(spec)


def test_padded_rows_that_move_real_rows_still_fail(tmp_path):
    (tmp_path / "mix.py").write_text(
        "import torch\nclass Mix(torch.nn.Module):\n    def forward(self, x):\n"
        "        return (x - x.mean(0, keepdim=True))[:, :3]\n"
        "def build():\n    return Mix()\n")
    spec = make_spec(tmp_path, model={"target": f"{tmp_path / 'mix.py'}:build"},
                     capture={"lazy": False, "verify": {"eager": True}})
    with pytest.raises(CaptureError, match="padded rows change real rows"):
        Runner(spec)


# ---- capture.lazy ----------------------------------------------------------------------------

def lazy_or_not(spec, lazy: bool) -> PipelineSpec:
    return spec.model_copy(update={"capture": spec.capture.model_copy(update={"lazy": lazy})})


def run_outputs(spec, out, **kw) -> tuple[np.ndarray, dict]:
    manifest = graphrun.run(spec, out=out, **kw)
    y = np.concatenate([np.load(f) for f in sorted(out.glob("part-*.y.npy"))])
    return y, {b.name: b for b in manifest.buckets}


@pytest.mark.parametrize("overlap", [False, True])
def test_lazy_sets_up_only_the_buckets_the_batches_select(tmp_path, overlap):
    """19 records in batches of 8: 8, 8 and a last 3, all in bucket 8: only it is set up."""
    spec = make_spec(tmp_path)
    want, every = run_outputs(lazy_or_not(spec, False), tmp_path / "all", overlap=overlap)
    assert {b.set_up for b in every.values()} == {"setup"}
    got, buckets = run_outputs(lazy_or_not(spec, True), tmp_path / "lazy", overlap=overlap)
    assert np.array_equal(got, want)
    assert buckets["batch=8"].set_up == "setup" and buckets["batch=8"].status == "eager"
    assert buckets["batch=8"].batches == 3
    for name in ("batch=1", "batch=64", "batch=128"):
        b = buckets[name]
        assert (b.status, b.set_up, b.warmup_s, b.lanes, b.batches) == (
            "unused", None, None, [], 0)
        assert "capture.lazy" in b.reason


@pytest.mark.parametrize("overlap", [False, True])
def test_a_bucket_first_selected_late_is_set_up_on_first_use(tmp_path, overlap):
    """49 records in batches of 8: the reader's look-ahead (4 batches) sees bucket 8 only; the
    seventh batch, of 1 record, needs bucket 1, which is set up then."""
    spec = make_spec(tmp_path, records=49)
    want, every = run_outputs(lazy_or_not(spec, False), tmp_path / "all", overlap=overlap)
    assert {b.set_up for b in every.values()} == {"setup"}
    got, buckets = run_outputs(lazy_or_not(spec, True), tmp_path / "lazy", overlap=overlap)
    assert np.array_equal(got, want)
    assert (buckets["batch=8"].set_up, buckets["batch=8"].batches) == ("setup", 6)
    one = buckets["batch=1"]
    assert (one.set_up, one.first_use_batch, one.batches, one.status) == (
        "first_use", 6, 1, "eager")
    # eager: set up without a warm-up or a check, so first use costs no model call
    assert one.lanes[0].verify is None and one.warmup_s is None
    assert buckets["batch=64"].status == "unused"


def test_the_python_api_sets_every_bucket_up_on_first_use(tmp_path):
    spec = counted_spec(tmp_path, capture={"lazy": True})
    with Runner(spec) as runner:
        assert [c[1] for c in calls_of(runner.model) if c[0] == "call"] == [1]  # the probe
        x = np.ones((2, 4), np.float32)
        got = runner.run_batch({"x": x})["y"]
        with torch.inference_mode():
            assert np.allclose(got, runner.model(torch.from_numpy(x)).numpy())
        reports = {r.name: r for r in runner.bucket_reports()}
    assert (reports["batch=2"].set_up, reports["batch=2"].first_use_batch) == ("first_use", 0)
    assert reports["batch=4"].status == reports["batch=1"].status == "unused"


def test_needs_from_batches_and_from_the_planners_shapes(tmp_path):
    spec = make_spec(tmp_path, buckets={"batch": [1, 8, 64], "seq": [16, 32]},
                     inputs={"x": {"shape": ["batch", "seq"]}},
                     outputs={"y": {"shape": ["batch", "seq"]}})
    table = BucketTable(spec)
    names = lambda found: sorted(b.name for b in found)  # noqa: E731
    # 3 records up to 20 long; 100 records split into 64 + 36 (data.oversize: split)
    assert names(shape_needs(table, np.array([[3, 20], [100, 9]]), split=True)) == [
        "batch=64,seq=16", "batch=8,seq=32"]
    assert names(shape_needs(table, np.array([[100, 9]]), split=False)) == []

    class RB:
        def __init__(self, n, longest):
            self.ids = list(range(n))
            self.lengths = {"seq": np.array([1] * (n - 1) + [longest])}
    assert names(batch_needs(table, [RB(1, 5), RB(8, 17)], split=True)) == [
        "batch=1,seq=16", "batch=8,seq=32"]
    # each bucket with its first batch that runs in it whole (a split one's part: none)
    first, again, split = RB(8, 17), RB(8, 20), RB(100, 9)
    found = batch_needs(table, [split, first, again], split=True)
    assert {b.name: rb for b, rb in found.items()} == {
        "batch=64,seq=16": None, "batch=8,seq=32": first}


def test_every_batch_the_reader_holds_by_setup_selects_its_bucket(tmp_path):
    """The reader read the whole file during setup: the last batch's bucket is set up at
    start too, with that batch to check it against eager; not only the first 4 batches'."""
    from graphrun.engine.lazy import data_needs
    from graphrun.read.stream import ReadAhead

    spec = make_spec(tmp_path, records=33)
    table = BucketTable(spec)

    class RB:
        def __init__(self, n):
            self.ids, self.lengths = list(range(n)), {}

    batches = [RB(8), RB(8), RB(8), RB(8), RB(1)]
    reader = ReadAhead(iter(batches), ahead=4, hold_bytes=1 << 30)
    assert reader._fetched.wait(5)  # the whole input read, as during a model's import
    found = data_needs(spec, reader)(table)
    assert {b.name: rb for b, rb in found.items()} == {"batch=8": batches[0],
                                                       "batch=1": batches[4]}
    reader.close()


# ---- the model built where it runs -----------------------------------------------------------

def test_weights_go_into_parameters_made_on_meta_and_equal_a_plain_load(tmp_path):
    """With model.weights the builder's parameters are made on the meta device (no random
    init), then the file's tensors become them: the same values as a build and a load."""
    spec = counted_spec(tmp_path)
    plain = build_model(spec, torch.device("cpu"), tmp_path)
    assert calls_of(plain.module if hasattr(plain, "module") else plain)[-1] == ("init", "cpu")
    state = {k: torch.randn_like(v) for k, v in plain.state_dict().items()}
    torch.save(state, tmp_path / "w.pt")
    with_weights = counted_spec(tmp_path, model={"target": f"{tmp_path / 'counted.py'}:build",
                                                 "weights": str(tmp_path / "w.pt")})
    model = build_model(with_weights, torch.device("cpu"), tmp_path)
    assert calls_of(model)[-1] == ("init", "meta")
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]) and v.device.type == "cpu"
    assert all(isinstance(p, torch.nn.Parameter) and not p.requires_grad
               for p in model.parameters())


def test_builtin_decoder_with_weights_equals_the_seeded_build(tmp_path):
    """The decoder's non-persistent KV cache is made as before and refilled from the loaded
    context; logits equal those of the model the weights were saved from."""
    from graphrun.models.builtin.decoder import build_decoder

    args = {"layers": 1, "d_model": 16, "heads": 2, "vocab": 50, "max_len": 8}
    ref = build_decoder(**args, max_batch=4, seed=3).eval()
    torch.save(ref.state_dict(), tmp_path / "d.pt")
    spec = make_spec(tmp_path, model={"builtin": "decoder", "args": args,
                                      "weights": str(tmp_path / "d.pt")},
                     inputs={"tokens": {"shape": ["batch", 1], "dtype": "int64",
                                        "range": [0, 50]},
                             "positions": {"shape": ["batch"], "dtype": "int64",
                                           "range": [0, 8]}},
                     outputs={"logits": {"shape": ["batch", 1, 50]}},
                     buckets={"batch": [4]})
    model = build_model(spec, torch.device("cpu"), tmp_path)
    tokens, positions = torch.tensor([[1], [7], [49], [0]]), torch.tensor([0, 3, 7, 5])
    with torch.inference_mode():
        assert torch.equal(model(tokens=tokens, positions=positions),
                           ref(tokens=tokens, positions=positions))


def test_a_builder_that_reads_its_parameters_is_built_as_usual(tmp_path):
    (tmp_path / "reads.py").write_text(
        "import torch\nclass R(torch.nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.lin = torch.nn.Linear(4, 3)\n"
        "        self.scale = float(self.lin.weight.detach().abs().sum()) > 0  # fails on meta\n"
        "    def forward(self, x):\n        return self.lin(x)\n"
        "def build():\n    return R()\n")
    plain = build_model(make_spec(tmp_path, model={"target": f"{tmp_path / 'reads.py'}:build"}),
                        torch.device("cpu"), tmp_path)
    torch.save(plain.state_dict(), tmp_path / "w.pt")
    spec = make_spec(tmp_path, model={"target": f"{tmp_path / 'reads.py'}:build",
                                      "weights": str(tmp_path / "w.pt")})
    model = build_model(spec, torch.device("cpu"), tmp_path)
    assert torch.equal(model.lin.weight, plain.lin.weight)


# ---- on the GPU (marked cuda; skipped without one) -------------------------------------------

@pytest.mark.cuda
def test_gpu_a_bucket_costs_its_warm_up_and_captures_no_extra_eager_run(tmp_path):
    """Python-side model calls per captured bucket: warm-up iterations, the call the capture
    records, and on the second lane one warm-up and one capture; the checks only replay."""
    spec = counted_spec(tmp_path, device="cuda", capture={"warmup_iters": 3, "lazy": False})
    with Runner(spec) as runner:
        runner.launcher.host_slots(3)  # the overlapped stream's second lane
        calls = [n for kind, n in calls_of(runner.model) if kind == "call"]
        assert calls == [1] + [4] * 4 + [2] * 4 + [1] * 4 + [4, 4, 2, 2, 1, 1]  # was 6 more: eager per lane
        for bucket, state in runner.states.items():
            assert state.status == "captured" and state.reference is None
            assert [lane.graphs[bucket].verify.passed for lane in runner.lanes] == [True, True]


@pytest.mark.cuda
@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_first_use_captures_on_every_lane_and_outputs_equal_lazy_false(tmp_path, overlap,
                                                                             monkeypatch):
    monkeypatch.setenv("GRAPHRUN_READ_AHEAD_BYTES", "0")  # the first 4 batches held, no more
    spec = make_spec(tmp_path, records=49, device="cuda")
    want, every = run_outputs(lazy_or_not(spec, False), tmp_path / "all", overlap=overlap)
    assert {b.set_up for b in every.values()} == {"setup"}
    got, buckets = run_outputs(lazy_or_not(spec, True), tmp_path / "lazy", overlap=overlap)
    np.testing.assert_array_equal(got, want)
    one = buckets["batch=1"]
    assert (one.status, one.set_up, one.first_use_batch, one.batches) == (
        "captured", "first_use", 6, 1)
    assert len(one.lanes) == (2 if overlap else 1)
    assert all(lane.verify.passed for lane in one.lanes)
    checked = [lane.verify.real_batch for lane in one.lanes if lane.verify.real_batch]
    assert len(checked) == 1 and checked[0].passed  # once, on the lane that ran it
    eight = buckets["batch=8"]
    assert (eight.status, eight.set_up, eight.batches) == ("captured", "setup", 6)
    # its first batch was read ahead: checked at setup, on the first lane, and run once
    assert eight.lanes[0].verify.real_batch.passed
    assert all(lane.verify.real_batch is None for lane in eight.lanes[1:])
    assert buckets["batch=128"].status == "unused" and buckets["batch=128"].capture_s is None


@pytest.mark.cuda
def test_gpu_weights_are_read_onto_the_device(tmp_path):
    spec = counted_spec(tmp_path)
    plain = build_model(spec, torch.device("cpu"), tmp_path)
    torch.save(plain.state_dict(), tmp_path / "w.pt")
    spec = counted_spec(tmp_path, device="cuda",
                        model={"target": f"{tmp_path / 'counted.py'}:build",
                               "weights": str(tmp_path / "w.pt")})
    model = build_model(spec, torch.device("cuda"), tmp_path)
    assert calls_of(model)[-1] == ("init", "meta")
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert torch.equal(model.lin.weight.cpu(), plain.lin.weight)
