"""Records as read: each input's values turned into arrays (Field), a chunk of candidate records
(Candidates), the valid records handed on (RecordBatch) and the rejected ones (Reject).

The checks that decide which records are valid live in checks.py (shape, axes, values)
and ids.py (duplicate ids).
"""

from __future__ import annotations


from dataclasses import dataclass, field
from typing import Union

import numpy as np

from graphrun.base.dtypes import host_numpy
from graphrun.spec.keys import InputSpec

NUMERIC_KINDS = "biuf"

Records = Union[np.ndarray, list]  # dense [n, ...] or one array per record


def numpy_dtype(dtype: str) -> np.dtype:
    return host_numpy(dtype)


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
    # data.group_by_length: the first ordinal of the window it was formed in (grouping.py),
    # and whether it is that window's last batch; None: batched in input order
    window: int | None = None
    window_end: bool = False
    # data.text: ordinals of its records whose text was cut to data.text's length (a checked
    # chunk's; the batches cut from it carry none, TextCuts counts them once per chunk)
    cut: np.ndarray | None = None

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
    cut: list[int] = field(default_factory=list)  # data.text: positions whose text was cut


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
    if value is None:  # the field itself, not an item of its lists
        return "null, where the record's value (an array of numbers, or a number) is expected"
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



class PackedRecords:
    """Records of one dtype and inner shape, varying along their first axis, laid end to end:
    flat [total, *inner] and lengths [n] (one array to pickle instead of n)."""

    def __init__(self, flat: np.ndarray, lengths: np.ndarray):
        self.flat, self.lengths = flat, lengths


def pack_records(records: Records) -> "Records | PackedRecords":
    """A list of arrays as PackedRecords where they share dtype and inner shape; else as is."""
    if (isinstance(records, np.ndarray) or not records
            or not all(isinstance(a, np.ndarray) and a.ndim >= 1 for a in records)):
        return records
    first = records[0]
    if any(a.dtype != first.dtype or a.shape[1:] != first.shape[1:] for a in records):
        return records
    lengths = np.fromiter((len(a) for a in records), np.int64, len(records))
    return PackedRecords(np.concatenate(records), lengths)


def unpack_records(records) -> Records:
    """pack_records undone: the records as views of the one array."""
    if not isinstance(records, PackedRecords):
        return records
    ends = np.cumsum(records.lengths).tolist()
    flat = records.flat
    return [flat[s:e] for s, e in zip([0] + ends[:-1], ends)]
