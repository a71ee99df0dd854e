"""Floating inputs are held in the model's dtype: static buffers and host slots in bfloat16 for a
bfloat16 model, whatever the spec's dtype; tensors of that dtype copied as they are, others
(float32, numpy) converted once on the way; checks see the user's values."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from graphrun import InputError, Runner
from graphrun.engine.buckets import Bucket
from graphrun.engine.buffers import BufferSet
from graphrun.spec.keys import PipelineSpec

SCALE = """
import torch
class Scale(torch.nn.Module):
    # elementwise, so a record's output is the same in any batch, bit for bit
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 2.0, 4))
    def forward(self, x):  # x: [batch, seq, 4]
        assert x.dtype == self.w.dtype, "the step passes the model's dtype"
        return x * self.w + 1
def build():
    return Scale()
"""


def spec_of(tmp_path, dtype: str = "float32", device: str = "cpu", **inp) -> PipelineSpec:
    (tmp_path / "m.py").write_text(SCALE)
    (tmp_path / "d.jsonl").write_text("")
    return PipelineSpec.model_validate({
        "version": 1, "name": "t", "device": device,
        "model": {"target": f"{tmp_path / 'm.py'}:build", "dtype": "bfloat16"},
        "inputs": {"x": {"shape": ["batch", "seq", 4], "dtype": dtype, **inp}},
        "outputs": {"y": {"shape": ["batch", "seq", 4]}},
        "buckets": {"batch": [1, 4], "seq": [2, 8]},
        "data": {"path": str(tmp_path / "d.jsonl")}, "output": {"dir": str(tmp_path / "o")}})


def alone(runner: Runner, x: np.ndarray) -> np.ndarray:
    """The model on one record, cast to bfloat16 by torch: the reference, bit for bit."""
    with torch.inference_mode():
        y = runner.model(x=torch.from_numpy(x)[None].to(runner.device, torch.bfloat16))
    return y[0].float().cpu().numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_static_buffers_and_host_slots_hold_the_models_dtype(tmp_path, dtype):
    with Runner(spec_of(tmp_path, dtype)) as runner:
        largest = runner.table.all[0]
        assert runner.layout.in_dtypes == {"x": torch.bfloat16}
        assert runner.lanes[0].inputs.view("x", largest).dtype == torch.bfloat16
        assert runner.launcher.slots[0].inputs.view("x", largest).dtype == torch.bfloat16


def test_tensors_of_any_float_dtype_and_numpy_give_the_same_bits(tmp_path):
    x = np.random.default_rng(0).standard_normal((3, 5, 4), dtype=np.float32) * 7
    with Runner(spec_of(tmp_path)) as runner:
        f32 = runner.run_batch({"x": torch.from_numpy(x)})["y"]
        bf16 = runner.run_batch({"x": torch.from_numpy(x).to(torch.bfloat16)})["y"]
        arrays = runner.run_batch({"x": x})["y"]
        ragged = runner.run_batch({"x": [x[0], x[1, :3], x[2, :1]]})["y"]
        want = [alone(runner, r) for r in x]
    assert f32.dtype == bf16.dtype == torch.bfloat16  # numpy: per-record float32 arrays
    assert [a.dtype for a in arrays] == [np.float32] * 3
    for i in range(3):
        np.testing.assert_array_equal(f32[i].float().numpy(), want[i])
        np.testing.assert_array_equal(bf16[i].float().numpy(), want[i])
        np.testing.assert_array_equal(arrays[i], want[i])
    np.testing.assert_array_equal(ragged[1], want[1][:3])  # padded in a float32 scratch
    np.testing.assert_array_equal(ragged[2], want[2][:1])


def test_checks_see_the_users_values_not_the_converted_ones(tmp_path):
    # 0.9999 rounds to 1.0 in bfloat16, past the range's end: the check sees 0.9999
    x = np.full((2, 2, 4), 0.9999, dtype=np.float32)
    with Runner(spec_of(tmp_path, range=[0, 1], finite=True)) as runner:
        for batch in ({"x": x}, {"x": torch.from_numpy(x)}):
            assert len(runner.run_batch(batch)["y"]) == 2
        x[1, 0, 2] = 1.5
        for batch in ({"x": x}, {"x": torch.from_numpy(x)}):
            with pytest.raises(InputError, match="outside its range"):
                runner.run_batch(batch)
        x[1, 0, 2] = np.nan
        with pytest.raises(InputError, match="NaN"):
            runner.run_batch({"x": torch.from_numpy(x)})


def test_pad_rows_converts_read_only_rows_without_a_warning(tmp_path):
    rows = np.random.default_rng(1).standard_normal((3, 2, 4), dtype=np.float32)
    np.save(tmp_path / "r.npy", rows)
    mapped = np.load(tmp_path / "r.npy", mmap_mode="r")  # read-only, as the npy reader's
    bucket = Bucket((4, 2), ("batch", "seq"))
    buffers = BufferSet({"x": ["batch", "seq", 4]}, {"x": torch.bfloat16}, bucket,
                        torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buffers.pad_rows("x", bucket, mapped, pad=-2.0)
    view = buffers.view("x", bucket)
    assert torch.equal(view[:3], torch.from_numpy(rows).to(torch.bfloat16))
    assert bool((view[3] == -2.0).all())


@pytest.mark.cuda
def test_on_the_gpu_every_input_form_gives_the_models_bits(tmp_path):
    """Captured: pinned bf16 (a plain copy), float32 host and device tensors (cast on the
    copy), numpy (converted as staged), and the file path's launch."""
    x = np.random.default_rng(2).standard_normal((3, 8, 4), dtype=np.float32)
    with Runner(spec_of(tmp_path, device="cuda")) as runner:
        assert runner.backend == "cuda-graph"
        want = np.stack([alone(runner, r) for r in x])
        forms = {"bf16": torch.from_numpy(x).to(torch.bfloat16).pin_memory(),
                 "f32": torch.from_numpy(x).pin_memory(), "device": torch.from_numpy(x).cuda()}
        for name, t in forms.items():
            got = runner.run_batch({"x": t})["y"]
            np.testing.assert_array_equal(got.float().numpy(), want, err_msg=name)
        np.testing.assert_array_equal(np.stack(runner.run_batch({"x": x})["y"]), want)
        outs, _, _ = runner.launcher.run_padded({"x": x}, 3, {"seq": np.full(3, 8)})
        np.testing.assert_array_equal(np.stack(outs["y"]), want)
