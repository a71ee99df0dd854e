"""Outputs picked and reduced by the spec inside the captured step (outputs.<name>.from,
reduce, topk, dtype): the model is wrapped in a module that does it, so that a [batch, seq,
hidden] or [batch, seq, vocab] tensor never leaves the GPU, only what is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphrun.base.dtypes import torch_dtype
from graphrun.base.errors import ModelError
from graphrun.spec.keys import OutputSpec, PipelineSpec



def needs_heads(spec: PipelineSpec) -> bool:
    return any(o.reduced for o in spec.outputs.values())


class Heads(nn.Module):
    """model(**inputs) (or positional), then per output: pick, reduce, top-k, cast. Returns a
    dict by output name; outputs without from/reduce/topk are taken from the return by name."""

    def __init__(self, model: nn.Module, outputs: dict[str, OutputSpec], input_names: list[str],
                 call: str):
        super().__init__()
        self.model, self.outputs, self.input_names, self.call = model, outputs, input_names, call

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> dict[str, torch.Tensor]:
        inputs = dict(zip(self.input_names, args)) if args else kwargs
        ret = self.model(*inputs.values()) if self.call == "positional" else self.model(**inputs)
        picked: dict[tuple, torch.Tensor] = {}  # (from, reduce) -> tensor, shared by outputs
        out = {}
        for name, o in self.outputs.items():
            key = (o.from_ if o.reduced else name, tuple(o.reduce), o.mask)
            if key not in picked:
                x = pick(ret, key[0], name)
                for op in o.reduce:
                    x = apply(op, x, inputs.get(o.mask), name, o.mask)
                picked[key] = x
            x = picked[key]
            if o.topk is not None:
                values, ids = torch.topk(x, o.topk.k, dim=-1)
                x = ids if o.topk.take == "ids" else values
            if o.dtype is not None and o.reduced:
                x = x.to(torch_dtype(o.dtype))
            out[name] = x
        return out


def pick(ret: Any, field: str | int | None, name: str) -> torch.Tensor:
    """One field of the model's return: a tensor, a tuple position, a key or an attribute."""
    if field is None:
        if isinstance(ret, torch.Tensor):
            return ret
        field = name
    if isinstance(field, int):
        if isinstance(ret, Mapping):
            ret = tuple(ret.values())
        if not isinstance(ret, (tuple, list)) or not -len(ret) <= field < len(ret):
            raise ModelError(f"outputs.{name}.from: {field} is no position of the model's "
                             f"return ({_kind(ret)})")
        x = ret[field]
    elif isinstance(ret, Mapping) and field in ret:
        x = ret[field]
    elif not isinstance(ret, (Mapping, torch.Tensor, tuple, list)) and hasattr(ret, field):
        x = getattr(ret, field)
    else:
        raise ModelError(f"outputs.{name}.from: the model's return has no field {field!r} "
                         f"({_kind(ret)})")
    if not isinstance(x, torch.Tensor):
        raise ModelError(f"outputs.{name}.from: {field!r} is a {type(x).__name__}, not a tensor")
    return x


def apply(op: str, x: torch.Tensor, mask: torch.Tensor | None, name: str,
          mask_name: str) -> torch.Tensor:
    """One reduce step. Pooling: x [B, S, ...], mask [B, S] (1 real, 0 padding)."""
    if op in ("mean_pool", "cls_pool", "last_pool") and x.dim() < 3:
        raise ModelError(f"outputs.{name}.reduce: {op} needs a [batch, seq, ...] tensor, got "
                         f"{list(x.shape)}")
    if op == "mean_pool":
        m = _mask(mask, name, op, mask_name).to(x.dtype).unsqueeze(-1)  # [B, S, 1]
        # as sentence-transformers pools: masked sum over the count, clamped for empty rows
        return (x * m).sum(1) / m.sum(1).clamp(min=1e-9)
    if op == "cls_pool":
        return x[:, 0]
    if op == "last_pool":
        if mask is None:
            return x[:, -1]
        last = (_mask(mask, name, op, mask_name).long().sum(1) - 1).clamp(min=0)  # [B]
        return x[torch.arange(x.shape[0], device=x.device), last]
    if op == "l2_normalize":
        return F.normalize(x, p=2, dim=-1)
    if op == "softmax":
        return torch.softmax(x.float(), dim=-1)
    if op == "log_softmax":
        return torch.log_softmax(x.float(), dim=-1)
    if op == "argmax":
        return x.argmax(dim=-1)
    raise AssertionError(f"unknown reduce step {op!r}")  # the spec allows only the above


def _mask(mask: torch.Tensor | None, name: str, op: str, mask_name: str) -> torch.Tensor:
    if mask is None:
        raise ModelError(f"outputs.{name}.reduce: {op} needs the mask input {mask_name!r}, "
                         "which the spec's inputs do not list; add it or set "
                         f"outputs.{name}.mask")
    return mask


def _kind(ret: Any) -> str:
    if isinstance(ret, torch.Tensor):
        return f"a tensor {list(ret.shape)}"
    if isinstance(ret, Mapping):
        return f"fields: {', '.join(map(str, ret))}"
    if isinstance(ret, (tuple, list)):
        return f"a {type(ret).__name__} of {len(ret)}"
    return f"a {type(ret).__name__}"
