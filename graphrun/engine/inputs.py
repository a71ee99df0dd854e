"""run_batch's inputs, checked as the reader checks a file's records: names, one record count,
rank, fixed sizes, integer data for integer inputs, `range` (an out-of-range index on the GPU
kills the CUDA context) and `finite`.

Dense torch tensors are kept as they are (on the host or the device), for a copy straight into
the static buffers; anything else becomes numpy rows, the file path's form.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from graphrun.base.errors import InputError
from graphrun.spec.keys import BATCH, FLOAT_DTYPES, InputSpec

FEW = 64  # values a host tensor's range is checked on as Python ints, not by a reduction


@dataclass
class ApiBatch:
    fields: dict  # name -> dense torch.Tensor [n, ...] (tensors) | np.ndarray | per-record list
    n: int
    lengths: dict[str, np.ndarray]  # per non-batch axis: each record's length
    tensors: bool  # every input a dense torch tensor

    def as_numpy(self) -> "ApiBatch":
        """The same rows as numpy (the file path's form; bfloat16 as float32)."""
        if not self.tensors:
            return self
        return ApiBatch({n: _to_numpy(t) for n, t in self.fields.items()}, self.n, self.lengths,
                        False)


def check_batch(inputs: dict, specs: dict[str, InputSpec], axes: tuple[str, ...]) -> ApiBatch:
    """inputs: name -> dense array/tensor [n, ...] or n per-record arrays."""
    if not isinstance(inputs, Mapping):
        raise InputError(f"run_batch takes a dict of input name -> rows ({', '.join(specs)}), "
                         f"got {type(inputs).__name__}")
    if len(inputs) != len(specs) or not all(name in inputs for name in specs):
        missing, extra = set(specs) - set(inputs), set(inputs) - set(specs)
        raise InputError(f"run_batch expects inputs {list(specs)}; missing {sorted(missing)}, "
                         f"unknown {sorted(extra)}")
    tensors = all(isinstance(v, torch.Tensor) for v in inputs.values())
    if tensors:
        return _check_tensors(inputs, specs, axes)
    fields, counts = {}, {}
    lengths: dict[str, list[int]] = {a: [] for a in axes[1:]}
    owner: dict[str, str] = {}  # axis -> the input its lengths came from
    for name, spec in specs.items():
        value = inputs[name]
        if isinstance(value, torch.Tensor):
            value = value.detach() if tensors else _to_numpy(value)
        elif not isinstance(value, np.ndarray) or (value.dtype == object and value.ndim == 1):
            # a 1-D object array (a pandas column of per-record arrays) is a list of records
            try:
                value = [_record(name, spec, i, r) for i, r in enumerate(value)]
            except TypeError:  # None, a number: no rows to take
                raise InputError(f"input {name!r} is {type(value).__name__}; pass a batch of "
                                 f"shape {_dims(spec.shape)} or a list of records") from None
        dense = not isinstance(value, list)
        if dense and value.ndim == 0:
            raise InputError(f"input {name!r} is a scalar; pass a batch of shape "
                             f"{_dims(spec.shape)}")
        n = len(value)
        for i, shape in enumerate([tuple(value.shape[1:])] if dense else
                                  [np.shape(r) for r in value]):
            _check_shape(name, spec, shape, i if not dense else None)
        for a in [value] if dense else value:
            _check_kind(name, spec, a.dtype.kind, a.dtype)
        for i, dim in enumerate(spec.shape[1:]):
            if isinstance(dim, str) and dim != BATCH:
                got = ([value.shape[i + 1]] * n if dense else [np.shape(r)[i] for r in value])
                if not lengths[dim]:
                    lengths[dim], owner[dim] = got, name
                elif got != lengths[dim]:
                    _disagree(owner[dim], name, dim, lengths[dim], got)
        _check_values(name, spec, value)
        fields[name], counts[name] = value, n
    if len(set(counts.values())) != 1:
        raise InputError(f"run_batch inputs disagree on the number of records: {counts}")
    return ApiBatch(fields, next(iter(counts.values())),
                    {a: np.asarray(v, dtype=np.int64) for a, v in lengths.items()}, tensors)


def _check_tensors(inputs: dict, specs: dict[str, InputSpec], axes: tuple[str, ...]) -> ApiBatch:
    """check_batch for dense tensors, kept short: run_batch's fast path goes through it."""
    fields, lengths, n = {}, {}, None
    owner: dict[str, str] = {}  # axis -> the input its lengths came from
    for name, spec in specs.items():
        t = inputs[name]
        if t.requires_grad:
            t = t.detach()
        shape = t.shape
        if not shape:
            raise InputError(f"input {name!r} is a scalar; pass a batch of shape "
                             f"{_dims(spec.shape)}")
        _check_shape(name, spec, tuple(shape[1:]), None)
        _check_kind(name, spec, "c" if t.dtype.is_complex else "b" if t.dtype == torch.bool
                    else "f", t.dtype)  # the kinds refused; any other dtype passes as a number
        if spec.finite or spec.range is not None or (
                spec.dtype not in FLOAT_DTYPES and t.is_floating_point()):
            _check_values(name, spec, t)
        for i, dim in enumerate(spec.shape[1:], start=1):
            if isinstance(dim, str) and dim not in lengths:
                lengths[dim], owner[dim] = np.full(shape[0], shape[i], dtype=np.int64), name
            elif isinstance(dim, str) and len(lengths[dim]) and lengths[dim][0] != shape[i]:
                _disagree(owner[dim], name, dim, lengths[dim], [shape[i]] * shape[0])
        if n is None:
            n = shape[0]
        elif shape[0] != n:
            counts = {k: inputs[k].shape[0] if inputs[k].dim() else 0 for k in specs}
            raise InputError(f"run_batch inputs disagree on the number of records: {counts}")
        fields[name] = t
    return ApiBatch(fields, n, {a: lengths.get(a, np.zeros(0, np.int64)) for a in axes[1:]},
                    True)


def _record(name: str, spec: InputSpec, i: int, r) -> np.ndarray:
    """One record of a list as an array; None, text and mappings are no record's values."""
    if r is None or isinstance(r, (str, bytes, Mapping)):
        shown = "None" if r is None else f"{type(r).__name__} {str(r)[:40]!r}"
        raise InputError(f"input {name!r}: record {i} is {shown}; pass an array of shape "
                         f"{_dims(spec.shape[1:])} ({spec.dtype})")
    try:
        return np.asarray(r)
    except ValueError:  # nested lists of unequal lengths: numpy makes no array of them
        raise InputError(f"input {name!r}: record {i} is ragged (nested lists of unequal "
                         f"lengths); pass an array of shape {_dims(spec.shape[1:])} "
                         f"({spec.dtype})") from None


def _check_shape(name: str, spec: InputSpec, shape: tuple, record: int | None) -> None:
    """A record's shape (without the batch axis) against the spec's: rank and fixed sizes."""
    want = spec.shape[1:]
    what = "each record" if record is None else f"record {record}"
    if len(shape) == len(want) and all(isinstance(w, str) or s == w
                                       for s, w in zip(shape, want)):
        empty = [w for s, w in zip(shape, want) if isinstance(w, str) and s == 0]
        if empty:  # as a file's record: nothing to run along that axis
            raise InputError(f"input {name!r}: {what} has {empty[0]} length 0; a record needs "
                             "at least one element")
        return
    raise InputError(f"input {name!r}: {what} has shape {_dims(shape)}, expected "
                     f"{_dims(want)} (inputs.{name}.shape {_dims(spec.shape)} without its "
                     "batch axis); pass rows of that shape")


def _check_kind(name: str, spec: InputSpec, kind: str, dtype) -> None:
    """A numpy dtype kind the input may hold, as a file's records: numbers, booleans only for a
    bool input (a cast would drop an imaginary part, or make None NaN past `finite`)."""
    if kind not in "biuf":
        raise InputError(f"input {name!r} is not numeric (dtype {dtype}); pass numbers for "
                         f"inputs.{name}.dtype {spec.dtype}")
    if kind == "b" and spec.dtype != "bool":
        raise InputError(f"input {name!r} holds booleans, but inputs.{name}.dtype is "
                         f"{spec.dtype}; pass numbers")


def _disagree(first: str, name: str, axis: str, had, got) -> None:
    """Inputs sharing an axis must agree on each record's length along it, as a file's do."""
    at = next(i for i, (a, b) in enumerate(zip(had, got)) if a != b)
    raise InputError(f"inputs {first!r} and {name!r} disagree on the {axis} length of record "
                     f"{at}: {had[at]} vs {got[at]}; pass rows of one length per record")


def _dims(dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _check_values(name: str, spec: InputSpec, value) -> None:
    if isinstance(value, list):
        if not value:
            return
        value = np.concatenate([np.ravel(r) for r in value])
    if value.numel() == 0 if isinstance(value, torch.Tensor) else value.size == 0:
        return
    is_float = (value.is_floating_point() if isinstance(value, torch.Tensor)
                else value.dtype.kind == "f")
    if is_float and spec.dtype not in FLOAT_DTYPES:
        raise InputError(f"input {name!r} holds floats, but inputs.{name}.dtype is {spec.dtype}; "
                         "pass integers")
    if spec.finite and is_float:
        finite = (bool(torch.isfinite(value).all()) if isinstance(value, torch.Tensor)
                  else bool(np.isfinite(value).all()))
        if not finite:
            raise InputError(f"input {name!r} holds NaN or Inf (inputs.{name}.finite is true)")
    if spec.range is not None:
        lo, hi = spec.range
        if isinstance(value, torch.Tensor) and value.is_cuda:
            # one transfer of both values: on the device, one wait for them
            low, high = torch.stack(torch.aminmax(value)).tolist()
        elif isinstance(value, torch.Tensor):
            low, high = _host_bounds(value)
        else:
            low, high = value.min(), value.max()
        if low < lo or high >= hi:
            raise InputError(f"input {name!r} holds values outside its range [{lo:g}, "
                             f"{hi:g}) (min {low}, max {high})")


def _host_bounds(t: torch.Tensor) -> tuple:
    """(min, max) of a host tensor: a few integers read as Python values (no torch op, a
    batch of a few tokens), else one reduction."""
    if t.numel() <= FEW and not t.is_floating_point():
        values = t.tolist()
        for _ in range(t.dim() - 1):
            values = [x for row in values for x in row]
        return min(values), max(values)
    return tuple(x.item() for x in torch.aminmax(t))


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
