"""Records and their checks: each input's values turned into arrays of the input's dtype, with the
record's shape, axis lengths, values and id checked.

A bad record gets one reason, from the first check it fails, in this order: reading (JSON,
fields, id), conversion to numbers, shape, shared axis lengths, values (integral, dtype bounds,
range, finite), duplicate id. Value checks run vectorized over a whole chunk of records.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from typing import Union

import numpy as np

from graphrun.spec import InputSpec, PipelineSpec

# numpy has no bfloat16: such inputs are held as float32 and cast on the copy to the device.
NUMPY_DTYPES = {
    "float32": np.float32, "float16": np.float16, "bfloat16": np.float32, "float64": np.float64,
    "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8,
    "bool": np.bool_,
}
NUMERIC_KINDS = "biuf"

Records = Union[np.ndarray, list]  # dense [n, ...] or one array per record


def numpy_dtype(dtype: str) -> np.dtype:
    return np.dtype(NUMPY_DTYPES[dtype])


@dataclass
class Reject:
    index: int  # 0-based ordinal of the record in the file
    id: object  # record id if it could be read, else None
    where: str  # "data.jsonl:12" (1-based line) or "data.npy[row 7]"
    reason: str  # what is wrong and, where useful, what is expected


class RowWhere:
    """The locations "file[row i]" of rows of an array file, formatted only when asked: dense
    files hold millions of records, and a string each cost the reader half its time, while
    only a rejected record's location is ever read. Behaves as a read-only list of str."""

    def __init__(self, file: str, rows: np.ndarray):
        self.file, self.rows = file, rows  # rows: [n] int64

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return RowWhere(self.file, self.rows[i])
        return f"{self.file}[row {int(self.rows[i])}]"

    def __iter__(self):
        return (f"{self.file}[row {r}]" for r in self.rows.tolist())

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def take(self, positions: np.ndarray) -> "RowWhere":
        return RowWhere(self.file, self.rows[positions])


def take_where(where, positions: np.ndarray):
    """where[p] for p in positions, staying lazy for RowWhere."""
    if isinstance(where, RowWhere):
        return where.take(positions)
    return [where[p] for p in positions.tolist()]


def concat_where(parts: list):
    """The locations of several batches' records, one after the other."""
    if all(isinstance(p, RowWhere) for p in parts) and len({p.file for p in parts}) == 1:
        return RowWhere(parts[0].file, np.concatenate([p.rows for p in parts]))
    return [w for p in parts for w in p]


@dataclass
class RecordBatch:
    indices: np.ndarray  # [n] int64 ordinals in the file
    # [n] id_field values, else the ordinals: an int64 array for ordinals and integer id
    # arrays/columns (no Python int per record), a list otherwise (strings, JSONL ids)
    ids: np.ndarray | list
    where: list[str] | RowWhere  # [n]
    fields: dict[str, Records]  # input -> [n, ...] when all records share a shape, else n arrays
    lengths: dict[str, np.ndarray]  # bucket axis other than batch -> [n] int64 length per record
    rejects: list[Reject] = field(default_factory=list)  # bad records met while filling it

    def __len__(self) -> int:
        return len(self.indices)


@dataclass
class Field:
    """One input's values for the records of a chunk, in the file's dtype."""

    dense: np.ndarray | None = None  # [n, ...] when every record has the same shape
    arrays: list | None = None  # otherwise n arrays, None where the record could not be read


@dataclass
class Candidates:
    """Records read from one chunk of the file, before their fields are checked."""

    indices: np.ndarray  # [n] int64 ordinals
    ids: np.ndarray | list | None  # [n] id_field values (see RecordBatch); None: the ordinals
    where: list[str]  # [n]
    fields: dict[str, Field]  # one per input
    problems: dict[int, str] = field(default_factory=dict)  # position in the chunk -> reason
    rejects: list[Reject] = field(default_factory=list)  # records that never became candidates


# ---- from the file's values: JSON-like lists (JSONL; Parquet with nulls) or Arrow columns ----

def field_from_values(name: str, inp: InputSpec, values: list,
                      bool_suspects: list[int] = ()) -> tuple[Field, dict[int, str]]:
    """values: [n] nested lists of numbers. bool_suspects: positions whose text holds true/false;
    numpy silently turns a bool among numbers into 0/1, so those records are walked for bools."""
    problems: dict[int, str] = {}
    if inp.dtype != "bool":
        for p in bool_suspects:
            if _holds_bool_or_deep(values[p]):
                problems[p] = f"{name}: boolean value where {inp.dtype} numbers are expected"
    dense = _as_dense(values)
    if dense is not None:
        if dense.dtype.kind == "b" and inp.dtype != "bool":
            problems = {p: f"{name}: boolean values where {inp.dtype} numbers are expected"
                        for p in range(len(values))}
        return Field(dense=dense), problems
    arrays: list = [None] * len(values)
    for p, value in enumerate(values):
        if p in problems:
            continue
        try:
            a = np.asarray(value)
        except (ValueError, TypeError):
            problems[p] = f"{name}: {describe_unreadable(value)}"
            continue
        if a.dtype.kind not in NUMERIC_KINDS:
            problems[p] = f"{name}: {describe_unreadable(value)}"
        elif a.dtype.kind == "b" and inp.dtype != "bool":
            problems[p] = f"{name}: boolean values where {inp.dtype} numbers are expected"
        else:
            arrays[p] = a
    return Field(arrays=arrays), problems


def field_from_arrow(col, rank: int) -> Field | None:
    """Records of a (nested) list column without copying through Python: dense [n, ...] when all
    share a shape, else one array per record when only the outermost length varies; None when
    there are nulls or inner dimensions vary."""
    import pyarrow.compute as pc

    outer, inner, level = None, [], col
    for depth in range(rank):
        if level.null_count:
            return None
        lengths = pc.list_value_length(level).to_numpy(zero_copy_only=False)  # one per list
        if depth == 0:
            outer = lengths
        elif len(lengths) and (lengths != lengths[0]).any():
            return None
        else:
            inner.append(int(lengths[0]) if len(lengths) else 0)
        level = level.flatten()
    if level.null_count:
        return None
    values = level.to_numpy(zero_copy_only=False)
    n = len(col)
    if rank == 0:
        return Field(dense=values)
    if 0 in inner:
        return None
    if (outer == outer[0]).all():
        return Field(dense=values.reshape((n, int(outer[0]), *inner)))
    ends = np.cumsum(outer) * int(np.prod(inner))
    return Field(arrays=[v.reshape((-1, *inner)) for v in np.split(values, ends[:-1])])


def _as_dense(values: list) -> np.ndarray | None:
    """[n, ...] numeric array when every value has the same shape; None otherwise (one numpy
    conversion for the whole chunk instead of one per record)."""
    try:
        dense = np.asarray(values)
    except (ValueError, TypeError):
        return None
    return dense if dense.dtype.kind in NUMERIC_KINDS else None


def _holds_bool_or_deep(value) -> bool:
    """A bool in it; or nested too deeply to look (numpy refuses it anyway)."""
    try:
        return _holds_bool(value)
    except RecursionError:
        return False


def _holds_bool(value) -> bool:
    if isinstance(value, list):
        return any(_holds_bool(v) for v in value)
    return isinstance(value, bool)


def describe_unreadable(value) -> str:
    """Why a JSON value is not a rectangular array of numbers: the first offending part."""
    try:
        return _first_unreadable(value) or "not an array of numbers"
    except RecursionError:  # lists in lists thousands deep: numpy stops at 64 dimensions
        return "nested too deeply (thousands of levels of lists): not an array of numbers"


def _first_unreadable(value) -> str:
    if isinstance(value, list):
        nested = [isinstance(v, list) for v in value]
        if any(nested) and not all(nested):
            return "ragged nested lists (numbers and lists mixed at one level)"
        if all(nested) and len({len(v) for v in value}) > 1:
            sizes = sorted({len(v) for v in value})
            return f"ragged nested lists (sublists of lengths {sizes[0]} and {sizes[-1]})"
        for v in value:
            reason = _first_unreadable(v)
            if reason:
                return reason
        return ""
    if value is None:
        return "null value where a number is expected"
    if isinstance(value, str):
        return f"non-numeric value {value!r} (a string)"
    if isinstance(value, dict):
        return "non-numeric value (a JSON object)"
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**64:
        return f"integer {value} does not fit in 64 bits"
    return ""


# ---- checks ------------------------------------------------------------------------------------

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
                if isinstance(value, float) and value.is_integer() and target.kind != "f":
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


def check_duplicate_ids(ids: np.ndarray | list, positions: np.ndarray, seen: set,
                        problems: dict[int, str]) -> None:
    """Only ids of records that passed every other check are remembered (as Python values:
    an int64 id and the same int are one id). An id is its text: 5 and "5" are one id (npy
    and Parquet write both as '5'), "05" and 5 are two."""
    if isinstance(ids, list):  # JSONL: ints and strings may mix
        ids = _as_compared(ids, seen)
    if not problems:  # the common case, by set operations: no Python step per id
        chunk = ids[positions].tolist() if isinstance(ids, np.ndarray) else (
            [ids[p] for p in positions.tolist()] if len(positions) < len(ids) else list(ids))
        fresh = set(chunk)
        if len(fresh) == len(chunk) and seen.isdisjoint(fresh):
            seen |= fresh
            return
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    for p in positions.tolist():
        if p in problems:
            continue
        rid = ids[p]
        if rid in seen:
            problems[p] = f"duplicate id {rid!r}: an earlier record has the same id"
        else:
            seen.add(rid)


_INT_TEXT = re.compile(r"-?(0|[1-9][0-9]*)")
# Markers kept in a file's set of seen ids: it held an int id, a str id, and was made canonical.
_INT_SEEN, _STR_SEEN, _CANONICAL = object(), object(), object()


def _as_compared(ids: list, seen: set) -> list:
    """ids as they are compared. Only once a file has both int and str ids does a str that is
    an int's text become that int (seen ids too, once): until then each is its own text, and
    a Python step per id would cost the common all-str file for nothing."""
    kinds = set(map(type, ids))
    if int in kinds:
        seen.add(_INT_SEEN)
    if str in kinds:
        seen.add(_STR_SEEN)
    if _INT_SEEN not in seen or _STR_SEEN not in seen:
        return ids
    if _CANONICAL not in seen:
        canonical = {_id_key(x) for x in seen}
        seen.clear()
        seen |= canonical
        seen.add(_CANONICAL)
    return [_id_key(x) for x in ids]


def _id_key(rid):
    """A str id that is an int's canonical text compares as that int."""
    if type(rid) is str and len(rid) < 20 and _INT_TEXT.fullmatch(rid):
        return int(rid)
    return rid


def dense_if_uniform(arrays: list) -> Records:
    """[n, ...] when every record has the same shape (and there is at least one)."""
    if arrays and len({a.shape for a in arrays}) == 1:
        return np.stack(arrays)
    return arrays


def take(records: Records, rows: np.ndarray) -> Records:
    """The records at positions rows [k] of a dense array or a list."""
    if isinstance(records, np.ndarray):
        return records[rows]
    return dense_if_uniform([records[i] for i in rows.tolist()])


# ---- one chunk ---------------------------------------------------------------------------------

@dataclass
class Prechecked:
    """A chunk after every check that needs no other chunk (all but duplicate ids): its
    records' problems so far, axis lengths and values in the inputs' dtypes. A Parquet row
    group's chunks are prechecked on the thread that decoded it (inputs/parquet.py), off the
    thread that hands out the batches."""

    indices: np.ndarray  # [n] int64 ordinals
    ids: np.ndarray | list | None  # [n], as Candidates.ids
    where: list[str] | RowWhere  # [n]
    rejects: list[Reject]  # records that never became candidates
    problems: dict[int, str]  # position in the chunk -> reason
    axes: dict[str, np.ndarray]  # axis -> [n] lengths, -1 where the shape is bad
    shaped: np.ndarray  # [g] positions with a good shape
    converted: dict[str, Records]  # input -> the records at `shaped`, in the input's dtype


def precheck(spec: PipelineSpec, c: Candidates) -> Prechecked:
    """The checks of one chunk that need nothing from the chunks before it. The chunk's fields
    are not kept: a field converted to another dtype no longer holds the file's values."""
    n = len(c.indices)
    problems = dict(c.problems)
    per_input = {name: record_lengths(name, inp, c.fields[name], spec, problems, n)
                 for name, inp in spec.inputs.items()}
    axes = check_shared_axes(per_input, problems)
    shaped = _not_in(np.arange(n), problems)  # [g] positions with a good shape
    converted = {name: check_values(name, inp, _records_at(c.fields[name], shaped, n),
                                    shaped, problems)
                 for name, inp in spec.inputs.items()}
    return Prechecked(c.indices, c.ids, c.where, c.rejects, problems, axes, shaped, converted)


class RecordChecker:
    """Checks chunk after chunk of one file; remembers the ids seen so far."""

    def __init__(self, spec: PipelineSpec):
        self.spec = spec
        self.seen_ids: set = set()

    def check(self, c: Candidates | Prechecked) -> RecordBatch:
        """The valid records of a chunk, in file order, with the chunk's rejects. A chunk
        prechecked already (on another thread) is only checked for duplicate ids here."""
        p = c if isinstance(c, Prechecked) else precheck(self.spec, c)
        n, problems, shaped = len(p.indices), p.problems, p.shaped
        if p.ids is not None:
            check_duplicate_ids(p.ids, shaped, self.seen_ids, problems)

        good = _not_in(shaped, problems)  # [k] positions of valid records
        if len(good) == len(shaped):
            fields = {name: r if isinstance(r, np.ndarray) else dense_if_uniform(r)
                      for name, r in p.converted.items()}
        else:
            kept = np.flatnonzero(np.isin(shaped, good, assume_unique=True))  # [k] into shaped
            fields = {name: take(r, kept) for name, r in p.converted.items()}
        ids = p.ids if p.ids is not None else p.indices
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
        )


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
