"""Record checks: each record's shape, shared axis lengths and values checked against the spec.

A bad record gets one reason, from the first check it fails, in this order: reading (JSON,
fields, id), conversion to numbers, shape, shared axis lengths, values (integral, dtype bounds,
range, finite), duplicate id. Value checks run vectorized over a whole chunk of records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphrun.read.ids import (SeenIds, check_duplicate_ids, check_npy_ids, mark_decided,
                               one_id_type)
from graphrun.read.records import (Candidates, Field, RecordBatch, Records, Reject, RowWhere,
                                   dense_if_uniform, numpy_dtype, pack_records, take,
                                   take_where, unpack_records)
from graphrun.spec.request import REQUEST_FIELD
from graphrun.spec.keys import InputSpec, PipelineSpec


def shape_problem(name: str, inp: InputSpec, shape: tuple, spec: PipelineSpec
                  ) -> tuple[str | None, dict[str, int]]:
    """Check one record's shape (without batch) against inp.shape[1:]; gives the reason, or the
    record's length along each named axis."""
    dims = inp.shape[1:]
    if len(shape) != len(dims):
        return (f"{name}: expected rank {len(dims)} per record (shape {_fmt(dims)}, the input "
                f"shape without batch), got rank {len(shape)} (shape {list(shape)})"), {}
    lengths: dict[str, int] = {}
    for k, (dim, size) in enumerate(zip(dims, shape)):
        if isinstance(dim, int):
            if size != dim:
                return (f"{name}: dimension {k} of a record must be {dim} (shape {_fmt(dims)}), "
                        f"got {size}"), {}
            continue
        if size == 0:
            return f"{name}: {dim} length is 0; a record needs at least one element", {}
        top = max(spec.buckets[dim]) if dim in spec.buckets else None
        if top is not None and size > top:
            return (f"{name}: {dim} length {size} exceeds the largest {dim} bucket {top}: add a "
                    f"bucket of at least {size} to buckets.{dim} or shorten the record"), {}
        if lengths.get(dim, size) != size:
            return f"{name}: the {dim} dimensions disagree ({lengths[dim]} vs {size})", {}
        lengths[dim] = size
    return None, lengths


def _fmt(dims: list) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def record_lengths(name: str, inp: InputSpec, f: Field, spec: PipelineSpec,
                   problems: dict[int, str], n: int) -> dict[str, np.ndarray]:
    """Shape-check every record of one input; axis -> [n] lengths, -1 where the record is bad."""
    if f.dense is not None:
        reason, lengths = shape_problem(name, inp, f.dense.shape[1:], spec)
        for p in range(n) if reason else ():
            problems.setdefault(p, reason)
        return {axis: np.full(n, size, np.int64) for axis, size in lengths.items()}
    out = {d: np.full(n, -1, np.int64) for d in inp.shape[1:] if isinstance(d, str)}
    seen: dict[tuple, tuple] = {}  # shape -> (reason, lengths): records mostly repeat shapes
    for p, a in enumerate(f.arrays):
        if a is None:
            continue
        reason, lengths = seen.get(a.shape) or seen.setdefault(
            a.shape, shape_problem(name, inp, a.shape, spec))
        if reason:
            problems.setdefault(p, reason)
        for axis, size in lengths.items():
            out[axis][p] = size
    return out


def check_shared_axes(per_input: dict[str, dict[str, np.ndarray]], problems: dict[int, str]
                      ) -> dict[str, np.ndarray]:
    """Inputs sharing an axis must agree on each record's length along it; axis -> [n]."""
    axes: dict[str, np.ndarray] = {}
    owner: dict[str, str] = {}
    for name, lengths in per_input.items():
        for axis, size in lengths.items():
            if axis not in axes:
                axes[axis], owner[axis] = size, name
                continue
            first = axes[axis]
            for p in np.flatnonzero((first >= 0) & (size >= 0) & (first != size)):
                problems.setdefault(int(p), f"inputs {owner[axis]} and {name} disagree on the "
                                    f"{axis} length: {first[p]} vs {size[p]}")
    return axes


def check_values(name: str, inp: InputSpec, records: Records, positions: np.ndarray,
                 problems: dict[int, str]) -> Records:
    """Check the values of one input and convert them to its dtype, vectorized over the chunk.
    records: [g, ...] or g arrays, all of a good shape; positions: [g] their chunk positions."""
    if len(positions) == 0:
        return records
    target = numpy_dtype(inp.dtype)
    flat, starts = _flatten(records)  # record i is flat[starts[i]:starts[i+1]]; none is empty
    ends = np.append(starts[1:], len(flat))

    def flag(bad: np.ndarray, describe) -> None:
        if not bad.any():  # the common case: no per-record reduction
            return
        for i in np.flatnonzero(np.logical_or.reduceat(bad, starts)):
            if int(positions[i]) not in problems:
                seg = slice(starts[i], ends[i])
                value = flat[seg][bad[seg]][0].item()
                if (isinstance(value, float) and value.is_integer() and target.kind != "f"
                        and abs(value) < 2**64):  # 1e300 stays 1e+300, not 301 digits
                    value = int(value)  # records of floats and ints were promoted together
                problems[int(positions[i])] = f"{name}: {describe(value)}"

    kind = flat.dtype.kind
    if target.kind in "iu":
        if kind == "f":
            flag(~(np.isfinite(flat) & (flat == np.trunc(flat))),
                 lambda v: f"non-integral value {v} where {inp.dtype} is expected")
        if not np.can_cast(flat.dtype, target):
            info = np.iinfo(target)
            flag((flat < info.min) | (flat > info.max),
                 lambda v: f"value {v} does not fit {inp.dtype} ({info.min}..{info.max})")
    if target.kind == "b" and kind != "b":
        flag((flat != 0) & (flat != 1),
             lambda v: f"value {v} where a boolean (true/false or 0/1) is expected")
    if inp.range is not None:
        lo, hi = (_num(x) for x in inp.range)
        flag(~((flat >= lo) & (flat < hi)),
             lambda v: f"value {v} is outside range [{lo}, {hi}) (lo <= x < hi)")
    with np.errstate(invalid="ignore", over="ignore"):  # bad values were flagged above
        converted = flat.astype(target, copy=False)  # already the dtype: no copy
    if inp.finite and target.kind == "f":
        # checked after the cast: a large float64 becomes Inf in float16
        finite = np.isfinite(converted)
        if not finite.all():
            flag(~finite, lambda v: (
                f"value {v} is "
                f"{'NaN or Inf' if not np.isfinite(v) else 'too large for ' + inp.dtype}"
                " (finite: true)"))
    if isinstance(records, np.ndarray):
        return converted.reshape(records.shape)
    return [converted[s:e].reshape(a.shape)
            for s, e, a in zip(starts.tolist(), ends.tolist(), records)]


def _num(x: float):
    return int(x) if float(x).is_integer() else x


def _flatten(records: Records) -> tuple[np.ndarray, np.ndarray]:
    """flat [total] and starts [g] of g records laid end to end."""
    if isinstance(records, np.ndarray):
        per_record = int(np.prod(records.shape[1:]))
        return records.reshape(-1), np.arange(len(records), dtype=np.int64) * per_record
    sizes = np.fromiter((a.size for a in records), np.int64, count=len(records))
    return np.concatenate([a.reshape(-1) for a in records]), np.cumsum(sizes) - sizes




@dataclass
class Prechecked:
    """A chunk after every check that needs no other chunk (all but duplicate ids): its
    records' problems so far, axis lengths and values in the inputs' dtypes. A Parquet row
    group's chunks are prechecked on the thread that decoded it (formats/parquet.py), off the
    thread that hands out the batches."""

    indices: np.ndarray  # [n] int64 ordinals
    ids: np.ndarray | list | None  # [n], as Candidates.ids
    where: list[str] | RowWhere  # [n]
    rejects: list[Reject]  # records that never became candidates
    problems: dict[int, str]  # position in the chunk -> reason
    axes: dict[str, np.ndarray]  # axis -> [n] lengths, -1 where the shape is bad
    shaped: np.ndarray  # [g] positions with a good shape
    converted: dict[str, Records]  # input -> the records at `shaped`, in the input's dtype
    cut: list[int] = field(default_factory=list)  # data.text: positions whose text was cut

    # a child process sends it pickled: records of varying length go as one array and their
    # lengths, not an array each (unpickling thousands of small arrays held the caller's GIL)
    def __getstate__(self) -> dict:
        return {**self.__dict__, "converted": {name: pack_records(r)
                                               for name, r in self.converted.items()}}

    def __setstate__(self, state: dict) -> None:
        state["converted"] = {name: unpack_records(r) for name, r in state["converted"].items()}
        self.__dict__.update(state)


def precheck(spec: PipelineSpec, c: Candidates) -> Prechecked:
    """The checks of one chunk that need nothing from the chunks before it. The chunk's fields
    are not kept: a field converted to another dtype no longer holds the file's values."""
    n = len(c.indices)
    problems = dict(c.problems)
    if c.ids is not None and spec.output.format == "npy":
        check_npy_ids(c.ids, problems)
    per_input = {name: record_lengths(name, inp, c.fields[name], spec, problems, n)
                 for name, inp in spec.inputs.items()}
    axes = check_shared_axes(per_input, problems)
    shaped = _not_in(np.arange(n), problems)  # [g] positions with a good shape
    converted = {name: check_values(name, inp, _records_at(c.fields[name], shaped, n),
                                    shaped, problems)
                 for name, inp in spec.inputs.items()}
    if REQUEST_FIELD in c.fields:  # each record's own generation parameters, carried along
        converted[REQUEST_FIELD] = _records_at(c.fields[REQUEST_FIELD], shaped, n)
    return Prechecked(c.indices, c.ids, c.where, c.rejects, problems, axes, shaped, converted,
                      c.cut)


class RecordChecker:
    """Checks chunk after chunk of one file; remembers the ids seen so far. duplicates: the
    job's duplicate ids decided beforehand (stream.job_duplicates: ordinal -> reason), for a
    checker that sees only part of the file in no set order (a Ray actor); ids are then not
    remembered. found_duplicates, if set to a dict, gets the duplicates this checker finds."""

    def __init__(self, spec: PipelineSpec, duplicates: dict[int, str] | None = None,
                 id_kind: tuple[str, object] | None = None):
        self.spec = spec
        self.seen_ids = SeenIds()
        self.duplicates = duplicates
        self._decided = np.array(sorted(duplicates or ()), np.int64)
        self.found_duplicates: dict[int, str] | None = None
        self.id_kind = id_kind  # formats.parquet_id_kind: one type of id in every Parquet shard

    def check(self, c: Candidates | Prechecked) -> RecordBatch:
        """The valid records of a chunk, in file order, with the chunk's rejects. A chunk
        prechecked already (on another thread) is only checked for duplicate ids here."""
        p = c if isinstance(c, Prechecked) else precheck(self.spec, c)
        n, problems, shaped = len(p.indices), p.problems, p.shaped
        rids = p.ids
        if self.id_kind is not None and rids is not None:
            rids = one_id_type(rids, self.id_kind, problems)
        if self.duplicates is not None:
            if self.duplicates:
                mark_decided(p.indices, shaped, self._decided, self.duplicates, problems)
        elif rids is not None:
            known = len(problems)
            check_duplicate_ids(rids, shaped, self.seen_ids, problems)
            if self.found_duplicates is not None and len(problems) > known:
                for q in list(problems)[known:]:  # a dict keeps its keys in insertion order
                    self.found_duplicates[int(p.indices[q])] = problems[q]

        good = _not_in(shaped, problems)  # [k] positions of valid records
        if len(good) == len(shaped):
            fields = {name: r if isinstance(r, np.ndarray) else dense_if_uniform(r)
                      for name, r in p.converted.items()}
        else:
            kept = np.flatnonzero(np.isin(shaped, good, assume_unique=True))  # [k] into shaped
            fields = {name: take(r, kept) for name, r in p.converted.items()}
        ids = rids if rids is not None else p.indices
        rejects = p.rejects + [Reject(int(p.indices[q]), _plain_id(ids[q]), p.where[q], reason)
                               for q, reason in problems.items()]
        everyone = len(good) == n
        return RecordBatch(
            indices=p.indices if everyone else p.indices[good],
            ids=ids if everyone else ids[good] if isinstance(ids, np.ndarray)
            else [ids[q] for q in good.tolist()],
            where=p.where if everyone else take_where(p.where, good),
            fields=fields,
            lengths={axis: p.axes[axis][good] for axis in self.spec.axes[1:] if axis in p.axes},
            rejects=sorted(rejects, key=lambda r: r.index),
            cut=_cut_ordinals(p, problems),
        )


def _cut_ordinals(p: Prechecked, problems: dict[int, str]) -> np.ndarray | None:
    """The ordinals of the valid records whose text was cut (a rejected one never ran)."""
    if not p.cut:
        return None
    kept = [q for q in p.cut if q not in problems]
    return p.indices[np.asarray(kept, np.int64)] if kept else None


def _plain_id(rid):
    """A record id as a Python value (an int64 array's element as an int)."""
    return rid.item() if isinstance(rid, np.generic) else rid


def _not_in(positions: np.ndarray, problems: dict[int, str]) -> np.ndarray:
    if not problems:
        return positions
    return positions[~np.isin(positions, np.fromiter(problems, np.int64, len(problems)))]


def _records_at(f: Field, positions: np.ndarray, n: int) -> Records:
    if f.dense is not None:
        return f.dense if len(positions) == n else f.dense[positions]
    return [f.arrays[p] for p in positions.tolist()]
