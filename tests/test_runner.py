"""The Runner on the CPU (eager backend): the same flow the graph backend uses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import graphrun
from graphrun import CaptureError, InputError, ModelError, Runner
from graphrun.manifest.keys import VerifyResult
from graphrun.models.load import build_model
from graphrun.spec.keys import PipelineSpec

from tests.overlap import most_at_once
from tests.spec_keys import with_keys

ENCODER = Path(__file__).resolve().parent.parent / "examples" / "models" / "tiny_encoder.py"

ROW_MIXER = """
import torch
class Mixer(torch.nn.Module):
    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)   # every row depends on the whole batch
def build():
    return Mixer()
"""

WRONG_SHAPE = """
import torch
class Wrong(torch.nn.Module):
    def forward(self, x):
        return x[:, :2]
def build():
    return Wrong()
"""


def mlp_spec(tmp_path, **over):
    (tmp_path / "d.jsonl").write_text("")
    raw = {"version": 1, "name": "t", "device": "cpu",
           "model": {"builtin": "mlp",
                     "args": {"in_features": 4, "hidden": 8, "layers": 2, "out_features": 3}},
           "inputs": {"x": {"shape": ["batch", 4]}},
           "outputs": {"y": {"shape": ["batch", 3]}},
           "buckets": {"batch": [1, 2, 4]},
           "data": {"path": str(tmp_path / "d.jsonl")}, "output": {"dir": str(tmp_path / "o")}}
    return PipelineSpec.model_validate(with_keys(raw, over))


def target_spec(tmp_path, source: str, out_shape=("batch", 4), **over):
    (tmp_path / "m.py").write_text(source)
    return mlp_spec(tmp_path, model={"target": f"{tmp_path / 'm.py'}:build"},
                    outputs={"y": {"shape": list(out_shape)}}, **over)


def eager_alone(spec, x: np.ndarray) -> np.ndarray:
    model = build_model(spec, torch.device("cpu"))
    with torch.inference_mode():
        return np.stack([model(x=torch.from_numpy(row[None]))[0].numpy() for row in x])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_run_batch_equals_eager_on_each_record_alone(tmp_path, n):
    spec = mlp_spec(tmp_path)
    x = np.random.default_rng(n).standard_normal((n, 4), dtype=np.float32)
    with Runner(spec) as runner:
        out = runner.run_batch({"x": x})
        assert out["y"].shape == (n, 3)
        np.testing.assert_allclose(out["y"], eager_alone(spec, x), rtol=1e-5, atol=1e-6)
        stats = runner.states[runner.table.pick(n, {})].stats
        assert stats["records"] == n and stats["padded_rows"] == runner.table.pick(n, {}).batch - n


@pytest.mark.parametrize("model_dtype, out_dtype", [("float32", "bfloat16"),
                                                     ("bfloat16", None)])
def test_bfloat16_outputs_are_rounded_in_the_step_and_float32_in_numpy(tmp_path, model_dtype,
                                                                       out_dtype):
    """A bfloat16 output (outputs.y.dtype over a float32 model, or a bfloat16 model's) is
    rounded to bfloat16 by the step's copy into its static buffer, which is bfloat16 (a copy
    out is a plain copy of the model's bytes); numpy gets float32 holding the bfloat16 values,
    and tensors in get bfloat16 tensors out."""
    spec = mlp_spec(tmp_path, model__dtype=model_dtype,
                    inputs={"x": {"shape": ["batch", 4], "dtype": model_dtype}},
                    outputs={"y": {"shape": ["batch", 3], "dtype": out_dtype}})
    x = np.random.default_rng(1).standard_normal((3, 4), dtype=np.float32)
    with Runner(spec) as runner:
        static = runner.lanes[0].outputs.views(runner.table.all[0])["y"]
        got = runner.run_batch({"x": x})["y"]
        as_tensor = runner.run_batch({"x": torch.from_numpy(x)})["y"]
        with torch.inference_mode():
            want = runner.model(x=torch.from_numpy(x).to(getattr(torch, model_dtype)))
    assert static.dtype == torch.bfloat16 and got.dtype == np.float32
    assert as_tensor.dtype == torch.bfloat16
    np.testing.assert_array_equal(as_tensor.float().numpy(), got)
    as_bf16 = torch.from_numpy(got).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(got, as_bf16)  # bfloat16 values, held as float32
    np.testing.assert_allclose(got, want.float().numpy(), rtol=2e-2, atol=2e-2)


def test_padding_values_never_change_real_rows(tmp_path):
    x = np.random.default_rng(0).standard_normal((3, 4), dtype=np.float32)
    with Runner(mlp_spec(tmp_path)) as a, Runner(mlp_spec(tmp_path, inputs={
            "x": {"shape": ["batch", 4], "pad": 1e6}})) as b:
        np.testing.assert_array_equal(a.run_batch({"x": x})["y"], b.run_batch({"x": x})["y"])


def test_oversize_split_runs_the_batch_in_chunks(tmp_path):
    spec = mlp_spec(tmp_path)
    x = np.random.default_rng(1).standard_normal((11, 4), dtype=np.float32)
    with Runner(spec) as runner:
        out, ran = runner.launcher.run_rows({"x": x}, 11, {})
        assert [b.batch for b, _ in ran] == [4, 4, 4]
        np.testing.assert_allclose(out["y"], eager_alone(spec, x), rtol=1e-5, atol=1e-6)


def test_oversize_eager_and_error(tmp_path):
    x = np.random.default_rng(2).standard_normal((6, 4), dtype=np.float32)
    spec = mlp_spec(tmp_path, data__oversize="eager")
    with Runner(spec) as runner:
        out, ran = runner.launcher.run_rows({"x": x}, 6, {})
        assert ran[0][0] is None
        np.testing.assert_allclose(out["y"], eager_alone(spec, x), rtol=1e-5, atol=1e-6)
    with Runner(mlp_spec(tmp_path, data__oversize="error", data__batch_size=4)) as runner:
        with pytest.raises(InputError, match="larger than the largest batch bucket"):
            runner.run_batch({"x": x})


def test_run_batch_accepts_tensors_and_rejects_wrong_names(tmp_path):
    with Runner(mlp_spec(tmp_path)) as runner:
        out = runner.run_batch({"x": torch.ones(2, 4)})
        assert out["y"].shape == (2, 3)
        with pytest.raises(InputError, match="missing \\['x'\\], unknown \\['z'\\]"):
            runner.run_batch({"z": np.ones((2, 4))})


def test_run_batch_gives_tensors_for_tensors_and_numpy_for_arrays(tmp_path):
    """Dense tensors in: tensors out in the model's dtype, fresh (not the static buffer), the
    same values as the numpy path; device=True keeps them on the runner's device."""
    spec = mlp_spec(tmp_path)
    x = np.random.default_rng(11).standard_normal((3, 4), dtype=np.float32)
    with Runner(spec) as runner:
        want = runner.run_batch({"x": x})["y"]
        got = runner.run_batch({"x": torch.from_numpy(x)})["y"]
        on_device = runner.run_batch({"x": torch.from_numpy(x)}, device=True)["y"]
        again = runner.run_batch({"x": torch.from_numpy(-x)})["y"]
    assert isinstance(want, np.ndarray) and isinstance(got, torch.Tensor)
    assert got.dtype == torch.float32 and on_device.device == runner.device
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(on_device.numpy(), want)
    assert not np.array_equal(again.numpy(), want)  # a later call did not overwrite `got`
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_allclose(want, eager_alone(spec, x), rtol=1e-5, atol=1e-6)


def test_run_batch_splits_tensors_beyond_the_largest_bucket(tmp_path):
    x = np.random.default_rng(12).standard_normal((11, 4), dtype=np.float32)
    with Runner(mlp_spec(tmp_path)) as runner:
        got = runner.run_batch({"x": torch.from_numpy(x)})["y"]
        assert runner.states[runner.table.pick(4, {})].stats["batches"] == 3  # 4 + 4 + 3
    assert isinstance(got, torch.Tensor) and got.shape == (11, 3)
    np.testing.assert_allclose(got.numpy(), eager_alone(mlp_spec(tmp_path), x), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("rows, message", [
    (np.ones((2, 3), dtype=np.float32), r"input 'x': each record has shape \[3\], expected "
                                        r"\[4\] \(inputs.x.shape \[batch, 4\]"),
    (torch.ones(2, 5), r"each record has shape \[5\], expected \[4\]"),
    (np.ones((2, 4, 1), dtype=np.float32), r"each record has shape \[4, 1\], expected \[4\]"),
    ([np.ones(4), np.ones(3)], r"input 'x': record 1 has shape \[3\], expected \[4\]"),
])
def test_run_batch_refuses_a_wrong_shape_instead_of_padding_it(tmp_path, rows, message):
    with Runner(mlp_spec(tmp_path)) as runner:
        with pytest.raises(InputError, match=message):
            runner.run_batch({"x": rows})


def test_run_batch_checks_finite_and_integer_data_as_the_reader_does(tmp_path):
    with Runner(mlp_spec(tmp_path, inputs={"x": {"shape": ["batch", 4], "finite": True}})) as r:
        bad = np.ones((2, 4), dtype=np.float32)
        bad[1, 2] = np.nan
        for rows in (bad, torch.from_numpy(bad)):
            with pytest.raises(InputError, match="input 'x' holds NaN or Inf"):
                r.run_batch({"x": rows})
    spec = PipelineSpec.model_validate({
        "version": 1, "name": "t", "device": "cpu",
        "model": {"builtin": "decoder", "args": {"layers": 1, "d_model": 8, "heads": 2,
                                                 "vocab": 50, "max_len": 8}},
        "inputs": {"tokens": {"shape": ["batch", 1], "dtype": "int64", "range": [0, 50]},
                   "positions": {"shape": ["batch"], "dtype": "int64", "range": [0, 8]}},
        "outputs": {"logits": {"shape": ["batch", 1, 50]}}, "buckets": {"batch": [1, 2]},
        "data": {"path": str(tmp_path / "d.jsonl")}, "output": {"dir": str(tmp_path / "o")}})
    with Runner(spec) as runner:
        with pytest.raises(InputError, match="input 'tokens' holds floats, but inputs.tokens"
                                             ".dtype is int64"):
            runner.run_batch({"tokens": np.array([[3.5]]), "positions": np.array([0])})
        with pytest.raises(InputError, match=r"input 'positions' holds values outside its "
                                             r"range \[0, 8\) \(min 0, max 9\)"):
            runner.run_batch({"tokens": torch.tensor([[3], [4]]), "positions": torch.tensor([0, 9])})
        out = runner.run_batch({"tokens": torch.tensor([[3], [4]]),
                                "positions": torch.tensor([0, 7])})["logits"]
        want = runner.run_batch({"tokens": np.array([[3], [4]]),
                                 "positions": np.array([0, 7])})["logits"]
        np.testing.assert_array_equal(out.numpy(), want)


def test_variable_length_records_are_cut_back_to_their_length(tmp_path):
    spec = encoder_spec(tmp_path)
    rng = np.random.default_rng(3)
    tokens = [rng.integers(0, 50, size=k) for k in (2, 7, 5)]
    masks = [np.ones(k, dtype=np.int64) for k in (2, 7, 5)]
    with Runner(spec) as runner:
        out = runner.run_batch({"tokens": tokens, "mask": masks})
        model = runner.model
        assert [h.shape for h in out["hidden"]] == [(2, 16), (7, 16), (5, 16)]
        for i, (t, m) in enumerate(zip(tokens, masks)):
            with torch.inference_mode():
                alone = model(tokens=torch.from_numpy(t)[None], mask=torch.from_numpy(m)[None])
            np.testing.assert_allclose(out["hidden"][i], alone["hidden"][0].numpy(), atol=1e-5)
            np.testing.assert_allclose(out["pooled"][i], alone["pooled"][0].numpy(), atol=1e-5)
        # dense tensors of one length (5, padded to seq=8): cut back to it, as the arrays are
        dense = runner.run_batch({"tokens": torch.from_numpy(np.stack([tokens[2]] * 2)),
                                  "mask": torch.from_numpy(np.stack([masks[2]] * 2))})
        assert dense["hidden"].shape == (2, 5, 16) and dense["pooled"].shape == (2, 16)
        np.testing.assert_allclose(dense["hidden"][1].numpy(), out["hidden"][2], atol=1e-5)


def encoder_spec(tmp_path):
    (tmp_path / "d.jsonl").write_text("")
    return PipelineSpec.model_validate({
        "version": 1, "name": "enc", "device": "cpu",
        "model": {"target": f"{ENCODER}:build",
                  "args": {"vocab": 50, "d_model": 16, "heads": 2, "layers": 1, "max_len": 8}},
        "inputs": {"tokens": {"shape": ["batch", "seq"], "dtype": "int64", "range": [0, 50]},
                   "mask": {"shape": ["batch", "seq"], "dtype": "int64", "range": [0, 2]}},
        "outputs": {"hidden": {"shape": ["batch", "seq", 16]}, "pooled": {"shape": ["batch", 16]}},
        "buckets": {"batch": [1, 4], "seq": [4, 8]},
        "data": {"path": str(tmp_path / "d.jsonl")}, "output": {"dir": "o", "format": "jsonl"}})


def test_run_batch_refuses_inputs_that_disagree_on_a_shared_axis(tmp_path):
    """tokens of 2 and 7 with masks of 7 and 2 ran, each record cut to the tokens' length."""
    with Runner(encoder_spec(tmp_path)) as runner:
        with pytest.raises(InputError, match="inputs 'tokens' and 'mask' disagree on the seq "
                                             "length of record 0: 2 vs 7"):
            runner.run_batch({"tokens": [np.ones(2, np.int64), np.ones(7, np.int64)],
                              "mask": [np.ones(7, np.int64), np.ones(2, np.int64)]})
        dense = np.ones((2, 6), np.int64), np.ones((2, 5), np.int64)
        for tokens, mask in (dense, [torch.from_numpy(a) for a in dense]):
            with pytest.raises(InputError, match="disagree on the seq length of record 0: 6 vs 5"):
                runner.run_batch({"tokens": tokens, "mask": mask})
        with pytest.raises(InputError, match="record 1 has seq length 0; a record needs at least"):
            runner.run_batch({"tokens": [np.ones(2, np.int64), np.ones(0, np.int64)],
                              "mask": [np.ones(2, np.int64), np.ones(0, np.int64)]})


@pytest.mark.parametrize("rows, message", [
    (np.array([[None] * 4] * 2), r"input 'x' is not numeric \(dtype object\)"),
    (np.ones((2, 4), np.complex64), r"input 'x' is not numeric \(dtype complex64\)"),
    (torch.ones(2, 4, dtype=torch.complex64), r"is not numeric \(dtype torch.complex64\)"),
    (np.array([["a"] * 4] * 2), r"input 'x' is not numeric"),
    (np.ones((2, 4), bool), "input 'x' holds booleans, but inputs.x.dtype is float32"),
    (torch.ones(2, 4, dtype=torch.bool), "holds booleans, but inputs.x.dtype is float32"),
    (None, r"input 'x' is NoneType; pass a batch of shape \[batch, 4\]"),
    (np.float32(1), r"input 'x' is float32; pass a batch"),
    ([np.ones(4), None], r"input 'x': record 1 is None; pass an array of shape \[4\] "
                         r"\(float32\)"),
    ([np.ones(4), "1 2 3 4"], r"input 'x': record 1 is str '1 2 3 4'; pass an array"),
    ([{"x": 1}], r"input 'x': record 0 is dict"),
])
def test_run_batch_refuses_what_is_not_numbers_as_the_reader_does(tmp_path, rows, message):
    """None became NaN past `finite: true`, a complex number lost its imaginary part, booleans
    and strings went through numpy's casts or out as a TypeError."""
    with Runner(mlp_spec(tmp_path, inputs={"x": {"shape": ["batch", 4], "finite": True}})) as r:
        with pytest.raises(InputError, match=message):
            r.run_batch({"x": rows})


def test_run_batch_names_a_ragged_record_and_takes_an_object_array_of_records(tmp_path):
    """A record of nested lists of unequal lengths was numpy's ValueError and its traceback;
    a 1-D object array of per-record arrays (a pandas column) was 'each record has shape []'."""
    with Runner(encoder_spec(tmp_path)) as runner:
        with pytest.raises(InputError, match=r"input 'tokens': record 1 is ragged \(nested "
                                             r"lists of unequal lengths\); pass an array of "
                                             r"shape \[seq\] \(int64\)"):
            runner.run_batch({"tokens": [[1, 2], [3, [4]]], "mask": [[1, 1], [1, 1]]})
        column = np.empty(2, dtype=object)
        column[:] = [np.array([1, 2, 3]), np.array([4])]
        out = runner.run_batch({"tokens": column, "mask": [[1, 1, 1], [1]]})
        want = runner.run_batch({"tokens": [[1, 2, 3], [4]], "mask": [[1, 1, 1], [1]]})
        assert [h.shape for h in out["hidden"]] == [(3, 16), (1, 16)]
        np.testing.assert_array_equal(out["pooled"], want["pooled"])


def test_runner_takes_a_spec_not_its_path(tmp_path):
    with pytest.raises(graphrun.GraphrunError, match="graphrun.Runner takes a PipelineSpec, got "
                                                     r"str: graphrun.load_spec\(path\)"):
        Runner("pipelines/encoder.yaml")


def test_run_batch_refuses_what_is_not_a_dict(tmp_path):
    with Runner(mlp_spec(tmp_path)) as runner:
        with pytest.raises(InputError, match=r"run_batch takes a dict of input name -> rows "
                                             r"\(x\)"):
            runner.run_batch(np.ones((2, 4), np.float32))


def test_a_closed_runner_says_so(tmp_path):
    """run_batch after close() was an AttributeError on the dropped launcher."""
    runner = Runner(mlp_spec(tmp_path))
    runner.close()
    with pytest.raises(graphrun.GraphrunError, match="this graphrun.Runner is closed"):
        runner.run_batch({"x": np.ones((2, 4), np.float32)})


def test_run_batch_from_two_threads_gives_each_its_own_rows(tmp_path):
    """Two threads shared the static buffers at once: one thread's rows came back as the
    other's, with no error. The second call now waits for the first."""
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2)]
    with Runner(mlp_spec(tmp_path)) as runner:
        alone = [runner.run_batch({"x": x})["y"] for x in xs]
        got = {}
        calls = [lambda k=k: got.setdefault(k, runner.run_batch({"x": xs[k]})["y"])
                 for k in (0, 1)]
        assert most_at_once(runner.direct, "arrays", calls, join_s=60) == 1
        for k in (0, 1):
            np.testing.assert_allclose(got[k], alone[k], atol=1e-6)


def test_verify_catches_a_model_that_mixes_rows(tmp_path):
    with pytest.raises(CaptureError) as info:  # every bucket set up, and checked, at start
        Runner(target_spec(tmp_path, ROW_MIXER, capture__lazy=False, capture__verify__eager=True))
    text = str(info.value)
    assert "bucket batch=4" in text and "padded rows change real rows of output(s) y" in text
    assert "1. fix the model" in text


def test_verify_off_lets_such_a_model_run(tmp_path):
    spec = target_spec(tmp_path, ROW_MIXER)
    spec.capture.verify.enabled = False
    with Runner(spec) as runner:
        assert all(g.verify is None for g in runner.lanes[0].graphs.values())


def test_output_shape_mismatch_names_the_output_and_the_fix(tmp_path):
    # found by the first call (the smallest bucket), not a warm-up: eager buckets have none
    with pytest.raises(ModelError, match=r"output 'y' has shape \[1, 2\] but the spec's "
                                         r"outputs.y.shape gives \[1, 4\]"):
        Runner(target_spec(tmp_path, WRONG_SHAPE, capture__lazy=False))


def test_cuda_graph_backend_without_cuda_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from graphrun import GraphrunError

    with pytest.raises(GraphrunError, match="cuda-graph needs a CUDA device"):
        Runner(mlp_spec(tmp_path, capture__backend="cuda-graph"))
    with pytest.raises(GraphrunError, match="no CUDA"):
        Runner(mlp_spec(tmp_path, device="cuda"))


def test_run_batch_checks_integer_ranges_before_the_copy(tmp_path):
    from graphrun.engine.inputs import check_batch

    (tmp_path / "d.jsonl").write_text("")
    spec = PipelineSpec.model_validate({
        "version": 1, "name": "dec", "device": "cpu",
        "model": {"builtin": "decoder",
                  "args": {"layers": 1, "d_model": 16, "heads": 2, "vocab": 50, "max_len": 8}},
        "inputs": {"tokens": {"shape": ["batch", 1], "dtype": "int64", "range": [0, 50]},
                   "positions": {"shape": ["batch"], "dtype": "int64", "range": [0, 8]}},
        "outputs": {"logits": {"shape": ["batch", 1, 50]}},
        "buckets": {"batch": [1, 2]},
        "data": {"path": str(tmp_path / "d.jsonl")}, "output": {"dir": str(tmp_path / "o")}})
    with Runner(spec) as runner:
        ok = runner.run_batch({"tokens": np.array([[3], [49]]), "positions": np.array([0, 7])})
        assert ok["logits"].shape == (2, 1, 50)
        with pytest.raises(InputError, match=r"input 'tokens' holds values outside its range "
                                             r"\[0, 50\) \(min 3, max 50\)"):
            runner.run_batch({"tokens": np.array([[3], [50]]), "positions": np.array([0, 7])})
        tokens = torch.tensor([[3], [49]])
        got = runner.run_batch({"tokens": tokens, "positions": torch.tensor([0, 7])})
        assert torch.equal(got["logits"], torch.from_numpy(ok["logits"]))
        with pytest.raises(InputError, match=r"input 'positions' holds values outside its "
                                             r"range \[0, 8\) \(min -1, max 7\)"):
            runner.run_batch({"tokens": tokens, "positions": torch.tensor([-1, 7])})
        many = torch.zeros(100, dtype=torch.int64)  # more values than a few: one reduction
        many[99] = 8
        with pytest.raises(InputError, match=r"\(min 0, max 8\)"):
            check_batch({"tokens": torch.zeros(100, 1, dtype=torch.int64), "positions": many},
                        spec.inputs, ("batch",))
        with pytest.raises(InputError, match=r"disagree on the number of records: "
                                             r"\{'tokens': 2, 'positions': 3\}"):
            runner.run_batch({"tokens": tokens, "positions": torch.tensor([0, 1, 2])})


def _replay_that_drifts(runner, bucket):
    """Stand in for a captured graph whose replay is off by 1 (what verify must catch)."""
    entry = runner.lanes[0].graphs[bucket]
    outputs = runner.lanes[0].outputs.views(bucket)

    def replay():
        entry.step()
        for t in outputs.values():
            t.add_(1.0)

    entry.run, entry.check_real = replay, True
    entry.verify = VerifyResult(passed=True, max_abs_err=0.0, max_rel_err=0.0)
    runner.states[bucket].status = "captured"


def test_first_real_batch_is_verified_and_a_drifting_replay_stops_the_run(tmp_path):
    spec = mlp_spec(tmp_path, capture__lazy=False)  # the bucket's graph there to replace
    x = np.random.default_rng(5).standard_normal((3, 4), dtype=np.float32)
    with Runner(spec) as runner:
        bucket = runner.table.pick(3, {})
        _replay_that_drifts(runner, bucket)
        with pytest.raises(CaptureError, match="bucket batch=4: verification failed: output 'y': "
                                               "on the first real batch, replay differs"):
            runner.run_batch({"x": x})
        assert runner.lanes[0].graphs[bucket].verify.real_batch.passed is False


def test_first_real_batch_failure_with_on_failure_eager_gives_eager_outputs(tmp_path):
    spec = mlp_spec(tmp_path, capture__on_failure="eager", capture__lazy=False)
    x = np.random.default_rng(6).standard_normal((3, 4), dtype=np.float32)
    with Runner(spec) as runner:
        bucket = runner.table.pick(3, {})
        _replay_that_drifts(runner, bucket)
        first = runner.run_batch({"x": x})["y"]   # the checked batch itself is eager's
        second = runner.run_batch({"x": x})["y"]
        state = runner.states[bucket]
        assert state.status == "eager" and "first real batch" in state.reason
        np.testing.assert_allclose(first, eager_alone(spec, x), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(first, second)


def _to_check(runner, bucket):
    """The bucket's first lane's entry as after a capture: its first real batch unchecked
    (the CPU's eager entries start with nothing to check)."""
    entry = runner.lanes[0].graphs[bucket]
    entry.check_real = True
    return entry


def test_a_replay_that_agrees_is_checked_once(tmp_path):
    spec = mlp_spec(tmp_path, capture__lazy=False, capture__verify__eager=True)
    x = np.random.default_rng(7).standard_normal((3, 4), dtype=np.float32)
    with Runner(spec) as runner:
        bucket = runner.table.pick(3, {})
        entry = _to_check(runner, bucket)
        runner.run_batch({"x": x})
        assert entry.verify.real_batch.passed is True and entry.check_real is False


class _Held:
    """A record batch as the reader holds it: what check_ahead reads of one."""

    def __init__(self, x: np.ndarray):
        self.ids, self.fields, self.lengths = list(range(len(x))), {"x": x}, {}


def test_the_first_batches_read_ahead_are_checked_at_setup_and_not_counted(tmp_path):
    spec = mlp_spec(tmp_path, capture__lazy=False)
    x = np.random.default_rng(8).standard_normal((3, 4), dtype=np.float32)
    with Runner(spec) as runner:
        bucket = runner.table.pick(3, {})
        _replay_that_drifts(runner, bucket)
        with pytest.raises(CaptureError, match="bucket batch=4: verification failed: output 'y': "
                                               "on the first real batch, replay differs"):
            runner.launcher.check_ahead({bucket: _Held(x)})
        assert runner.states[bucket].stats["batches"] == 0  # the stream runs it, not setup


def test_a_batch_checked_at_setup_is_not_checked_again_in_the_stream(tmp_path):
    spec = mlp_spec(tmp_path, capture__lazy=False, capture__verify__eager=True)
    x = np.random.default_rng(9).standard_normal((3, 4), dtype=np.float32)
    with Runner(spec) as runner:
        bucket = runner.table.pick(3, {})
        entry = _to_check(runner, bucket)
        other = runner.table.pick(1, {})
        runner.launcher.check_ahead({bucket: _Held(x), other: None})  # None: no batch held
        state = runner.states[bucket]
        assert entry.verify.real_batch.passed is True and not entry.check_real
        assert state.real_checked and state.stats["batches"] == 0
        checked = []
        runner.launcher.check_real = lambda lane, st: checked.append(st.bucket)
        np.testing.assert_allclose(runner.run_batch({"x": x})["y"], eager_alone(spec, x),
                                   rtol=1e-5, atol=1e-6)
        assert checked == [] and state.stats["batches"] == 1


def test_a_check_at_setup_is_not_one_of_the_runs_batches(tmp_path):
    """A bucket set up on first use names the batch that needed it: the run's first, though a
    batch read ahead was replayed at setup to be checked."""
    spec = mlp_spec(tmp_path, capture__verify__eager=True)  # capture.lazy: on first use
    x = np.random.default_rng(10).standard_normal((3, 4), dtype=np.float32)
    with Runner(spec, needs=lambda table: {table.pick(3, {}): None}) as runner:
        bucket = runner.table.pick(3, {})
        _to_check(runner, bucket)
        runner.launcher.check_ahead({bucket: _Held(x)})
        runner.run_batch({"x": x[:1]})  # bucket batch=1, not set up yet
        one = runner.states[runner.table.pick(1, {})]
        assert (one.set_up, one.first_use_batch) == ("first_use", 0)


def test_a_model_that_does_not_take_the_spec_inputs_is_a_clear_model_error(tmp_path):
    (tmp_path / "m.py").write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, features):\n"
        "        return features\n"
        "def build():\n"
        "    return M()\n")
    spec = mlp_spec(tmp_path, model={"target": f"{tmp_path / 'm.py'}:build"},
                    outputs={"y": {"shape": ["batch", 4]}})
    with pytest.raises(ModelError) as info:
        Runner(spec)
    text = str(info.value)
    assert "the model failed on its first call, model(x=[1, 4] float32) for bucket batch=1" in text
    assert "unexpected keyword argument 'x'" in text and "model.call: positional" in text


def test_half_precision_outputs_are_compared_at_their_own_precision():
    from graphrun.engine.verify import compare

    want = torch.tensor([4.0, 2.5, 1e-4, -3.0], dtype=torch.bfloat16)
    # one bfloat16 unit at the largest magnitude (4: 0.03125) on every element, the near-zero
    # one included: rounding, as kernels picked under capture give
    nudged = want.float() + torch.tensor([0.03125, -0.0156, 0.0156, 0.0156])
    assert compare(nudged.to(torch.bfloat16), want, 1e-3, 1e-3)[0]
    # a real mistake is still caught, and float32 keeps the plain tolerance
    assert not compare((want.float() * 1.1).to(torch.bfloat16), want, 1e-3, 1e-3)[0]
    assert not compare(nudged, want.float(), 1e-3, 1e-3)[0]


def test_on_the_cpu_more_slots_add_no_second_lane(tmp_path):
    """A second lane (each bucket captured again) is for captured graphs: on the CPU more host
    slots leave one lane, and batches on every slot still give eager's outputs."""
    spec = mlp_spec(tmp_path)
    x = np.random.default_rng(8).standard_normal((3, 4), dtype=np.float32)
    with Runner(spec) as runner:
        assert runner.launcher.host_slots(4) == 4 and len(runner.lanes) == 1
        for slot in range(4):
            bucket = runner.launcher.stage({"x": x}, 3, {}, slot)
            outs, _ = runner.launcher.launch(bucket, slot, 3, {}).result()
            np.testing.assert_allclose(outs["y"], eager_alone(spec, x), rtol=1e-5, atol=1e-6)


def test_buckets_the_reader_shows_while_setup_runs_are_set_up_before_the_stream(tmp_path):
    """capture.lazy decides from the batches read ahead; the reader goes on meanwhile, so what
    it holds once the first buckets are set up is set up too, at setup, not mid-stream."""
    spec = mlp_spec(tmp_path)
    looks = []

    def needs(table):  # the reader's view: one bucket first, a second one by the next look
        looks.append(1)
        found = {table.pick(3, {}): None}
        if len(looks) > 1:
            found[table.pick(1, {})] = None
        return found

    with Runner(spec, needs=needs) as runner:
        first, late = runner.table.pick(3, {}), runner.table.pick(1, {})
        assert len(looks) == 2
        assert runner.states[first].set_up == runner.states[late].set_up == "setup"
        assert runner.states[late].status in ("captured", "eager")
        unused = [b for b in runner.table.all if b not in (first, late)]
        assert unused and all(runner.states[b].status == "unused" for b in unused)
        runner.run_batch({"x": np.ones((1, 4), np.float32)})
        assert runner.states[late].first_use_batch is None  # no setup on first use


def test_checking_a_few_host_integers_runs_no_torch_op():
    """run_batch's check of a decode step's batch (a few token ids on the host) reads their
    values, with no reduction dispatched per input and call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphrun.engine.inputs import check_batch

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ran = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ran.append(str(func))
            return func(*args, **(kwargs or {}))

    spec = PipelineSpec.model_validate({
        "version": 1, "name": "dec", "model": {"builtin": "decoder"},
        "inputs": {"tokens": {"shape": ["batch", 1], "dtype": "int64", "range": [0, 50]},
                   "positions": {"shape": ["batch"], "dtype": "int64", "range": [0, 8]}},
        "outputs": {"logits": {"shape": ["batch", 1, 50]}}, "buckets": {"batch": [1, 8]},
        "data": {"path": "d.jsonl"}, "output": {"dir": "o"}})
    batch = {"tokens": torch.tensor([[3], [49]]), "positions": torch.tensor([0, 7])}
    with Ops() as ops:
        checked = check_batch(batch, spec.inputs, ("batch",))
    assert checked.n == 2 and checked.tensors
    assert ops.ran == []


@pytest.mark.parametrize("as_tensors", [False, True])
def test_a_record_longer_than_every_bucket_names_the_axis_its_inputs_and_the_largest(
        as_tensors):
    spec = graphrun.load_spec(Path(__file__).resolve().parent.parent / "pipelines" / "encoder.yaml")
    ones = np.ones((1, 300), np.int64)
    batch = {"tokens": ones, "mask": ones}
    if as_tensors:
        batch = {k: torch.from_numpy(v) for k, v in batch.items()}
    with Runner(spec) as runner:
        with pytest.raises(InputError) as e:
            runner.run_batch(batch)
    assert str(e.value) == (
        "no bucket covers the batch: 300 along seq (tokens, mask), more than the largest seq "
        "bucket, 64: cut the input to fit, or add a larger value to the spec's buckets")
