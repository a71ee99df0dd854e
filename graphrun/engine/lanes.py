"""Lanes: one set of static buffers and the graphs captured on them.

A Lane owns its static input and output buffers, allocated once at the largest bucket (each
bucket is a view, buffers.py), one graph per bucket captured on those views, and the event after
which its buffers are free again (its last batch's outputs copied out). Lanes are alike: the
first is made with the runner; the overlapped stream adds a second (Launcher.host_slots), so that
one lane's copies run while the other lane's graph replays. A bucket that runs eagerly keeps an
entry whose `run` is the eager step on the lane's views (graphs.Graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from graphrun.engine.buckets import Bucket
from graphrun.engine.buffers import BufferSet
from graphrun.engine.graphs import Graph
from graphrun.base.errors import ModelError
from graphrun.models.call import call_model, name_outputs
from graphrun.engine.verify import fill_synthetic


@dataclass(frozen=True)
class Layout:
    """Names, spec shapes and dtypes of the static buffers, the same on every lane.

    Inputs are held in the dtype the model takes (a floating input in model.dtype,
    models/load.py's model_input_dtypes), so the step casts nothing and a batch already in
    that dtype is copied in as it is; outputs in the model's dtype (or outputs.<name>.dtype),
    so a copy out is a plain copy of the model's own bytes."""

    in_dims: dict[str, list]
    in_dtypes: dict[str, torch.dtype]
    out_dims: dict[str, list]
    out_dtypes: dict[str, torch.dtype]


class Lane:
    def __init__(self, index: int, layout: Layout, largest: Bucket, device: torch.device,
                 input_specs: dict):
        self.index = index
        self.inputs = BufferSet(layout.in_dims, layout.in_dtypes, largest, device)
        self.outputs = BufferSet(layout.out_dims, layout.out_dtypes, largest, device)
        # never garbage: an index the model looks up must be in range, even in a warm-up
        fill_synthetic(self.inputs.views(largest), input_specs,
                       torch.Generator().manual_seed(index))
        self.graphs: dict[Bucket, Graph] = {}
        self.free = None  # CUDA event: this lane's last batch is out of its static buffers

    def make_step(self, bucket: Bucket, model, call: str, layout: Layout) -> Callable[[], None]:
        return make_step(model, call, self.inputs.views(bucket), self.outputs.views(bucket))

    def drop(self) -> None:
        self.graphs.clear()
        self.free = None


def make_step(model: torch.nn.Module, call: str, inputs: dict[str, torch.Tensor],
              outputs: dict[str, torch.Tensor]) -> Callable[[], None]:
    """The unit that is warmed up, captured and replayed: static inputs -> static outputs.

    Each output is copied into its static buffer, which rounds it to that buffer's dtype
    (outputs.<name>.dtype) where the model gives a wider one.
    """
    names = list(outputs)

    def step() -> None:
        with torch.inference_mode():
            got = name_outputs(call_model(model, inputs, call), names)
        for name, t in got.items():
            dst = outputs[name]
            if t.shape != dst.shape:
                raise ModelError(output_shape_problem(name, list(t.shape), list(dst.shape)))
            dst.copy_(t)

    return step


def output_shape_problem(name: str, got: list[int], want: list[int]) -> str:
    """What is wrong when a model's output does not fit its static buffer: the batch
    dimension is the model's to keep (one row per input row), the others the spec's to say."""
    head = (f"output {name!r} has shape {got} but the spec's outputs.{name}.shape gives "
            f"{want} for this bucket")
    if not got or got[0] != want[0]:
        rows = got[0] if got else "no"
        return (f"{head}: the model returned {rows} rows for a batch of {want[0]}; the model "
                "must return one row per input row along dimension 0 (a reduction or an "
                "indexing over the batch, such as x[0] or x.mean(0), drops it); fix the "
                "model's forward, not the spec")
    return f"{head}; fix outputs.{name}.shape (a name in it is a bucket axis)"
