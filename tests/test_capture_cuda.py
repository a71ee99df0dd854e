"""CUDA graph capture and replay on a GPU (marked `cuda`; skipped where there is none)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import graphrun
from graphrun import CaptureError, Runner
from graphrun.models.call import call_model, name_outputs
from graphrun.models.load import build_model
from graphrun.spec.keys import PipelineSpec

pytestmark = pytest.mark.cuda
ROOT = Path(__file__).resolve().parent.parent
# the real-model pipelines (Hugging Face, timm) have their own tests: tests/test_real_models.py
PIPELINES = sorted(p for p in (ROOT / "pipelines").glob("*.yaml")
                   if not any(k in p.read_text() for k in ("  hf:", "  timm:")))

SYNCS_ON_ITEM = """
import torch
class Syncs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
    def forward(self, x):
        scale = x.abs().max().item()   # a host sync: not allowed while capturing
        return self.lin(x) / (1 + scale)
def build():
    return Syncs()
"""


def small_spec(tmp_path, **over) -> PipelineSpec:
    (tmp_path / "d.jsonl").write_text("")
    raw = {"version": 1, "name": "t", "device": "cuda",
           "model": {"builtin": "mlp",
                     "args": {"in_features": 32, "hidden": 64, "layers": 4, "out_features": 8}},
           "inputs": {"x": {"shape": ["batch", 32]}},
           "outputs": {"y": {"shape": ["batch", 8]}},
           "buckets": {"batch": [1, 2, 4, 8, 16, 32]},
           "data": {"path": str(tmp_path / "d.jsonl")}, "output": {"dir": str(tmp_path / "o")}}
    raw.update(over)
    return PipelineSpec.model_validate(raw)


def syncing_spec(tmp_path, **capture) -> PipelineSpec:
    """small_spec of a model that syncs with the host in forward, so no bucket captures."""
    (tmp_path / "m.py").write_text(SYNCS_ON_ITEM)
    return small_spec(tmp_path, model={"target": f"{tmp_path / 'm.py'}:build"},
                      inputs={"x": {"shape": ["batch", 4]}}, outputs={"y": {"shape": ["batch", 4]}},
                      capture={"lazy": False, **capture})


def test_every_bucket_is_captured_and_verified(tmp_path):
    with Runner(small_spec(tmp_path, capture={"lazy": False})) as runner:
        assert runner.backend == "cuda-graph"
        for state in runner.states.values():
            assert state.status == "captured", state.reason
            verify = runner.lanes[0].graphs[state.bucket].verify
            assert verify.passed, verify
            assert verify.pad_isolated is (True if state.bucket.batch > 1 else None)
            assert state.capture_s > 0


@pytest.mark.parametrize("path", PIPELINES, ids=[p.stem for p in PIPELINES])
def test_replay_equals_eager_per_record_for_shipped_pipelines(path):
    spec = graphrun.load_spec(path, ["capture.lazy=false"])  # every bucket captured at start
    records = _records(spec, 40)
    with Runner(spec) as runner:
        assert {s.status for s in runner.states.values()} == {"captured"}
        model = runner.model
        for start in range(0, len(records), 7):  # odd batch sizes: padding in most buckets
            chunk = records[start:start + 7]
            batch = {k: [np.asarray(r[k]) for r in chunk] for k in spec.inputs}
            batch = {k: np.stack(v) if len({a.shape for a in v}) == 1 else v
                     for k, v in batch.items()}
            out = runner.run_batch(batch)
            for i, rec in enumerate(chunk):
                with torch.inference_mode():
                    inputs = {k: torch.as_tensor(np.asarray(rec[k]))[None].to(
                        runner.device, runner.layout.in_dtypes[k]) for k in spec.inputs}
                    want = name_outputs(call_model(model, inputs, spec.model.call),
                                        list(spec.outputs))
                for name in spec.outputs:
                    np.testing.assert_allclose(out[name][i], want[name][0].float().cpu().numpy(),
                                               rtol=1e-3, atol=1e-3)


def _records(spec, n):
    path = spec.data.path
    if path.suffix == ".npy":
        return [{next(iter(spec.inputs)): row} for row in np.load(path)[:n]]
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def test_decoder_bf16_buckets_capture_and_match_eager(tmp_path):
    spec = small_spec(tmp_path, model={"builtin": "decoder", "dtype": "bfloat16",
                                       "args": {"layers": 4, "d_model": 256, "heads": 4,
                                                "vocab": 2048, "max_len": 256}},
                      inputs={"tokens": {"shape": ["batch", 1], "dtype": "int64",
                                         "range": [0, 2048]},
                              "positions": {"shape": ["batch"], "dtype": "int64",
                                            "range": [0, 256]}},
                      outputs={"logits": {"shape": ["batch", 1, 2048]}},
                      capture={"verify": {"rtol": 2e-2, "atol": 2e-2}, "lazy": False})
    with Runner(spec) as runner:
        assert all(s.status == "captured" for s in runner.states.values())
        assert all(g.verify.passed for g in runner.lanes[0].graphs.values())
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 2048, size=(5, 1))
        positions = rng.integers(0, 256, size=5)
        out = runner.run_batch({"tokens": tokens, "positions": positions})["logits"]
        with torch.inference_mode():
            want = runner.model(tokens=torch.as_tensor(tokens, device="cuda"),
                                positions=torch.as_tensor(positions, device="cuda"))
        np.testing.assert_allclose(out, want.float().cpu().numpy(), rtol=2e-2, atol=2e-2)


def test_shared_pool_takes_less_memory_than_a_pool_per_graph(tmp_path):
    def total(pool):
        spec = small_spec(tmp_path, capture={"pool": pool, "lazy": False},
                          model={"builtin": "mlp", "args": {"in_features": 32, "hidden": 1024,
                                                            "layers": 8, "out_features": 8}})
        with Runner(spec) as runner:
            return sum(s.memory_bytes for s in runner.states.values())

    shared, separate = total("shared"), total("per-graph")
    assert shared < separate, (shared, separate)


def test_host_sync_in_forward_fails_with_the_model_line_and_remedies(tmp_path):
    with pytest.raises(CaptureError) as info:
        Runner(syncing_spec(tmp_path))
    text = str(info.value)
    assert "bucket batch=32" in text and "CUDA graph capture failed" in text
    assert f"{tmp_path / 'm.py'}:8 in forward" in text and ".item()" in text
    assert "1. remove host synchronisations" in text


@pytest.fixture
def eager_fallback(tmp_path) -> PipelineSpec:
    """The host-syncing model with on_failure: eager: every bucket's capture fails."""
    return syncing_spec(tmp_path, on_failure="eager")


def test_on_failure_eager_runs_the_uncapturable_buckets_eagerly(eager_fallback):
    with Runner(eager_fallback) as runner:
        assert {s.status for s in runner.states.values()} == {"eager"}
        assert all("CUDA graph capture failed" in s.reason for s in runner.states.values())
        x = np.random.default_rng(0).standard_normal((3, 4), dtype=np.float32)
        out = runner.run_batch({"x": x})["y"]
        with torch.inference_mode():
            want = runner.model(torch.as_tensor(x, device="cuda")).cpu().numpy()
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_a_failed_capture_leaves_the_devices_random_ops_working(eager_fallback):
    """A capture that fails mid-way must not leave the CUDA generator marked as capturing:
    random ops after it (a model built on the GPU, sampling) run, from the seed's stream."""
    with Runner(eager_fallback) as runner:
        assert {s.status for s in runner.states.values()} == {"eager"}
    torch.cuda.manual_seed(7)
    first = torch.rand(4, device="cuda").cpu()
    torch.cuda.manual_seed(7)
    assert torch.equal(torch.rand(4, device="cuda").cpu(), first)
    assert torch.nn.Linear(3, 2, device="cuda").weight.device.type == "cuda"


def test_memory_budget_drops_the_largest_buckets(tmp_path):
    args = {"in_features": 32, "hidden": 4096, "layers": 4, "out_features": 8}
    spec = small_spec(tmp_path, model={"builtin": "mlp", "args": args},
                      buckets={"batch": [1, 64, 4096]},
                      capture={"memory_budget_mib": 8, "lazy": False})
    with Runner(spec) as runner:
        states = {s.bucket.batch: s for s in runner.states.values()}
        assert states[4096].status == "skipped" and "memory_budget_mib=8" in states[4096].reason
        assert states[1].status == "captured"
        assert runner.table.max_batch < 4096
        x = np.random.default_rng(0).standard_normal((100, 32), dtype=np.float32)
        out, ran = runner.launcher.run_rows({"x": x}, 100, {})  # split over the buckets still there
        assert out["y"].shape == (100, 8) and all(b.batch < 4096 for b, _ in ran)


def test_a_memory_budget_that_drops_every_bucket_is_one_error(tmp_path):
    """Were every bucket dropped, no batch would have one to run in: the run stops at setup
    with what the last one needs and what to change."""
    args = {"in_features": 32, "hidden": 4096, "layers": 4, "out_features": 8}
    spec = small_spec(tmp_path, model={"builtin": "mlp", "args": args},
                      buckets={"batch": [64, 4096]},
                      capture={"memory_budget_mib": 0.01, "lazy": False})
    with pytest.raises(CaptureError, match="drops every bucket: the last, batch=64") as info:
        Runner(spec)
    assert "raise capture.memory_budget_mib" in str(info.value)


def test_a_second_capture_that_fails_leaves_the_bucket_on_one_lane(tmp_path, monkeypatch):
    """The overlapped stream's second lane is an optimisation: a bucket whose second capture
    fails keeps running on its first lane alone (a warning says so), the others take both
    lanes, and every output is still the model's."""
    import graphrun.engine.graphs as graphs_mod
    from graphrun.base.errors import CaptureError as Err

    spec = small_spec(tmp_path, buckets={"batch": [4, 16]}, capture={"lazy": False})
    warnings = []
    with Runner(spec, log=warnings.append) as runner:
        real = graphs_mod.capture_graph

        def fails_for_16(step, name, **kw):
            if name == "batch=16":
                raise Err("CUDA graph capture failed: injected", bucket=name)
            return real(step, name, **kw)

        # a patch: a capture failing inside the runner's graph pool, with no caller
        monkeypatch.setattr(graphs_mod, "capture_graph", fails_for_16)
        runner.launcher.host_slots(3)
        on = {b.batch: [lane.index for lane in runner.lanes if b in lane.graphs]
              for b in runner.states}
        assert on == {16: [0], 4: [0, 1]}
        assert any("batch=16 runs without lane 1" in w and "injected" in w for w in warnings)
        x = np.random.default_rng(3).standard_normal((40, 32), dtype=np.float32)
        for n in (16, 16, 4, 4, 3, 16):
            got = runner.run_batch({"x": x[:n]})["y"]
            with torch.inference_mode():
                want = runner.model(torch.as_tensor(x[:n], device="cuda")).cpu().numpy()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_compile_true_is_captured_and_matches_eager(tmp_path):
    spec = small_spec(tmp_path, model={"builtin": "mlp", "compile": True,
                                       "args": {"in_features": 32, "hidden": 64, "layers": 2,
                                                "out_features": 8}},
                      buckets={"batch": [1, 4]}, capture={"lazy": False})
    with Runner(spec) as runner:
        assert {s.status for s in runner.states.values()} == {"captured"}
        x = np.random.default_rng(0).standard_normal((3, 32), dtype=np.float32)
        out = runner.run_batch({"x": x})["y"]
        eager = build_model(spec, torch.device("cuda"))
        with torch.inference_mode():
            want = eager(torch.as_tensor(x, device="cuda")).cpu().numpy()
        np.testing.assert_allclose(out, want, rtol=1e-3, atol=1e-3)


def test_graphrun_run_on_the_gpu_writes_a_manifest_with_captured_buckets(tmp_path):
    spec = graphrun.load_spec(ROOT / "pipelines" / "decoder-step.yaml",
                              ["report.baseline=eager", "capture.lazy=false"])
    m = graphrun.run(spec, out=tmp_path / "o")
    assert m.status == "completed" and m.environment.backend == "cuda-graph"
    assert m.environment.gpu
    assert all(b.status == "captured" for b in m.buckets)
    assert m.totals.records_out == 1996 and m.totals.records_rejected == 4  # make_data.py
    used = [b for b in m.buckets if b.batches]
    assert all(b.latency_us["replay"]["p50"] > 0 for b in used)
    assert all(b.speedup and b.speedup > 1 for b in m.buckets), [b.speedup for b in m.buckets]
    # overlapped (the GPU's default): every bucket captured again for the second lane
    assert m.totals.overlapped and all(len(b.lanes) == 2 and all(lane.verify.passed
                                                                 for lane in b.lanes)
                                       for b in m.buckets)


def test_overlapped_stream_on_two_lanes_gives_serials_outputs_bit_for_bit(tmp_path):
    """Overlapped, batches take the two lanes in turn (each bucket captured twice, on two sets
    of static buffers), one slot per batch in flight: batches of every bucket in a row, through
    all the slots, give the serial path's outputs (one lane) exactly, each record the model's
    on it alone, with positive phase timings; each bucket's second graph is checked on its
    first real batch too, and its capture reuses the first one's pool blocks."""
    from graphrun.engine.launch import slot_count
    from graphrun.feed.loop import feed_stream
    from graphrun.read.records import RecordBatch

    spec = small_spec(tmp_path, model={"builtin": "mlp", "dtype": "bfloat16",
                                       "args": {"in_features": 32, "hidden": 256, "layers": 8,
                                                "out_features": 8}},
                      inputs={"x": {"shape": ["batch", 32], "dtype": "bfloat16"}},
                      capture={"verify": {"rtol": 2e-2, "atol": 2e-2}, "lazy": False})
    rng = np.random.default_rng(1)
    sizes = [32, 1, 7, 32, 3, 16, 32, 2, 9, 32] * 6
    data, start = [], 0
    for n in sizes:
        idx = np.arange(start, start + n)
        data.append(RecordBatch(indices=idx, ids=idx.tolist(), where=[""] * n,
                                fields={"x": rng.standard_normal((n, 32)).astype("f4")},
                                lengths={}, rejects=[]))
        start += n

    class Keep:
        def __init__(self):
            self.rows, self.times = [], []

        def write(self, indices, ids, outputs, batch_start=None):
            self.rows.append(outputs["y"].copy())

        def reject(self, *a):
            raise AssertionError("no rejects")

    with Runner(spec) as runner:
        got, grown = {}, {}
        for overlap in (False, True):
            grown[overlap] = {b: s.memory_bytes for b, s in runner.states.items()}
            w = got[overlap] = Keep()
            feed_stream(runner.launcher, data, w,
                        on_batches=lambda ran, n, first, w=w: w.times.extend(t for _, t in ran),
                        on_read=lambda rb: None, should_stop=lambda: False,
                        overlap=overlap)
            assert len(runner.lanes) == (2 if overlap else 1)
        assert len(runner.launcher.slots) == slot_count(runner.launcher.slot_bytes) > 2
        for bucket, state in runner.states.items():
            second = runner.lanes[1].graphs[bucket]
            assert second.verify.passed, second.verify
            # the bucket's first real batch was checked once, on the lane that ran it
            checks = [lane.graphs[bucket].verify.real_batch for lane in runner.lanes]
            assert state.real_checked and sum(c is not None for c in checks) == 1, checks
            assert all(c.passed for c in checks if c is not None)
            # the second lane's graph went into the first one's pool, reusing its blocks
            assert state.memory_bytes - grown[False][bucket] <= 2 << 20, state.memory_bytes
        # batches take the lanes in turn, whatever their bucket: lane 1 runs some of them
        on_second = []
        for bucket, entry in runner.lanes[1].graphs.items():
            entry.run = lambda run=entry.run, b=bucket: (on_second.append(b), run())[1]
        feed_stream(runner.launcher, data, Keep(), on_batches=lambda ran, n, first: None,
                    on_read=lambda rb: None, should_stop=lambda: False, overlap=True)
        assert len(on_second) >= 3
        serial, overlapped = (np.concatenate(got[k].rows) for k in (False, True))
        assert serial.dtype == np.float32  # bf16 outputs as float32 in numpy
        np.testing.assert_array_equal(serial, overlapped)
        assert all(t["h2d"] > 0 and t["replay"] > 0 and t["d2h"] > 0 for t in got[True].times)
        x = np.concatenate([rb.fields["x"] for rb in data])
        with torch.inference_mode():
            want = runner.model(torch.as_tensor(x, device="cuda").to(torch.bfloat16))
        np.testing.assert_allclose(overlapped, want.float().cpu().numpy(), rtol=2e-2, atol=2e-2)


def test_run_batch_with_tensors_gives_the_numpy_paths_values_in_the_models_dtype(tmp_path):
    """Tensors in (host or device), tensors out: on the host in the model's dtype (pinned),
    or on the device with device=True; the values are the numpy path's, which gives float32
    for bfloat16. Padded (3 rows in bucket 4) and exact (4 rows) alike."""
    spec = small_spec(tmp_path, model={"builtin": "mlp", "dtype": "bfloat16",
                                       "args": {"in_features": 32, "hidden": 64, "layers": 4,
                                                "out_features": 8}},
                      inputs={"x": {"shape": ["batch", 32], "dtype": "bfloat16"}},
                      capture={"verify": {"rtol": 2e-2, "atol": 2e-2}})
    x = np.random.default_rng(4).standard_normal((4, 32), dtype=np.float32)
    with Runner(spec) as runner:
        for n in (3, 4):
            want = runner.run_batch({"x": x[:n]})["y"]
            host = runner.run_batch({"x": torch.from_numpy(x[:n]).pin_memory()})["y"]
            dev = runner.run_batch({"x": torch.from_numpy(x[:n]).cuda()}, device=True)["y"]
            assert host.dtype == dev.dtype == torch.bfloat16 and host.is_pinned()
            assert dev.device.type == "cuda" and host.shape == dev.shape == (n, 8)
            np.testing.assert_array_equal(host.float().numpy(), want)
            np.testing.assert_array_equal(dev.float().cpu().numpy(), want)
        with pytest.raises(graphrun.InputError, match=r"input 'x': each record has shape \[31\]"):
            runner.run_batch({"x": torch.zeros(2, 31, device="cuda")})


def test_a_seeded_targets_replay_equals_its_users_own_eager_call(tmp_path):
    """A randomly initialised target is built as its user's code builds it (on the CPU, then
    moved): replayed, it gives what the user's own model gives eagerly on the GPU."""
    from tests.test_models import users_own

    own = users_own(tmp_path).build(max_batch=8).to("cuda").eval()
    spec = small_spec(tmp_path, model={"target": f"{tmp_path / 'seeded.py'}:build"},
                      inputs={"x": {"shape": ["batch", 8]}}, outputs={"y": {"shape": ["batch", 4]}},
                      buckets={"batch": [1, 2, 4, 8]}, capture={"lazy": False})
    x = np.random.default_rng(0).standard_normal((8, 8), dtype=np.float32)
    with Runner(spec) as runner:
        assert {s.status for s in runner.states.values()} == {"captured"}
        got = runner.run_batch({"x": x})["y"]
    with torch.inference_mode():
        want = own(torch.as_tensor(x, device="cuda")).cpu().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
