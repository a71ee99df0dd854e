"""Parquet input: a column per input (nested lists for the axes after batch), and one of ids.

pyarrow decodes a column chunk on one thread, releasing the GIL meanwhile: so up to
tuning.parquet_threads row groups are decoded at once, each whole on a pool thread, which also
converts and checks its chunks (see pool_chunk), at most tuning.parquet_ahead_bytes ahead of
the caller, in file order. A row group too big to decode on one thread in time is cut into
pieces (parquet_split.py) decoded the same way; one that cannot be cut is streamed when its
turn comes, and so is the rest of a row group from a piece or row group whose decoding failed:
a damaged page raises, naming the file, after the chunks before it. Columns become records in
parquet_columns.py.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pyarrow.parquet as pq

from graphrun.base.errors import InputError
from graphrun.read.formats.parquet_columns import check_schema, parquet_candidates
from graphrun.read.formats.parquet_split import Piece, plan_pieces
from graphrun.read.checks import Prechecked, precheck
from graphrun.read.records import Candidates, numpy_dtype
from graphrun.spec.keys import PipelineSpec
from graphrun.base.tuning import Tuning

# Bytes per decoded value of each Parquet physical type; other types (strings) are counted at
# their uncompressed size in the file.
VALUE_BYTES = {"BOOLEAN": 1, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}
# Bytes of the Python objects a checked chunk holds per record: a string id (a str and its
# list slot), and a record of an input with a named axis after batch (a numpy view each).
PY_STR_BYTES = 64
PY_ARRAY_BYTES = 144


class ParquetReader:
    suffix = ".parquet"

    def __init__(self, path: Path, spec: PipelineSpec, tuning: Tuning):
        self.path, self.spec, self.tuning = path, spec, tuning

    def count(self) -> int:
        """Records in the file, from its metadata."""
        return self._open().metadata.num_rows

    def check(self) -> None:
        """Whole-file problems: columns missing, of the wrong type or nesting."""
        check_schema(self.spec, self._open().schema_arrow, self.path.name)

    def chunks(self, start: int, stop: int | None) -> Iterator[Candidates | Prechecked]:
        pf = self._open()
        check_schema(self.spec, pf.schema_arrow, self.path.name)
        meta = pf.metadata
        stop = meta.num_rows if stop is None else min(stop, meta.num_rows)
        spans, row = [], 0  # (row group, its first row) of those holding rows [start, stop)
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if row + n > start and row < stop:
                spans.append((g, row))
            row += n
        if not spans or start >= stop:
            return
        for chunk in _Decoding(self, pf, spans, start, stop).chunks():
            # prechecked on a pool thread, or a record batch left to this thread (pool_chunk)
            yield chunk if isinstance(chunk, Prechecked) else parquet_candidates(
                self.spec, self.path.name, *chunk)

    def _open(self) -> pq.ParquetFile:
        return open_parquet(self.path, self.tuning)


def open_parquet(path: Path, tuning: Tuning, metadata=None) -> pq.ParquetFile:
    # pre_buffer off and a buffer: pages are read a little at a time, not a column chunk at once
    try:
        return pq.ParquetFile(path, metadata=metadata, pre_buffer=False,
                              buffer_size=tuning.parquet_buffer_bytes)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for unreadable files
        raise InputError(f"cannot read the Parquet file: {e}", where=path.name) from e


class _Decoding:
    """One pass over rows [start, stop): row groups (ints) and pieces (parquet_split.Piece)
    move from `todo` to `ahead` as they start decoding on the pool, and leave `ahead` in file
    order as their chunks are handed out."""

    def __init__(self, reader: ParquetReader, pf, spans: list[tuple[int, int]], start: int,
                 stop: int):
        self.path, self.spec, self.tuning = reader.path, reader.spec, reader.tuning
        self.pf, self.meta, self.start, self.stop = pf, pf.metadata, start, stop
        id_field = self.spec.data.id_field
        # a text column is read in place of the inputs it is tokenized into (inputs/text.py)
        text = self.spec.data.text
        self.columns = (([text.field] if text else list(self.spec.inputs))
                        + ([id_field] if id_field else []))
        self.first = dict(spans)
        self.sizes = {g: decoded_bytes(self.meta.row_group(g), self.spec) for g, _ in spans}
        rows = sum(self.meta.row_group(g).num_rows for g, _ in spans)
        t = self.tuning
        step = min(t.array_chunk_rows,
                   max(1, t.array_chunk_bytes * rows // max(sum(self.sizes.values()), 1)))
        # whole batches per chunk where it can: a batch across a chunk edge is a copy of its rows
        batch = self.spec.data.batch_size
        self.step = step - (step % batch if step > batch else 0)
        self.per_row = values_per_row(self.spec)
        self.chunk = functools.partial(pool_chunk, self.spec, self.path.name)
        self.todo, self.ahead = deque(self.first), deque()  # ahead: (unit, future or None)
        self.plans: dict = {}  # row group -> future of its pieces (or of None)

    def chunks(self) -> Iterator:
        self.pool = ThreadPoolExecutor(self.tuning.parquet_threads, thread_name_prefix="parquet",
                                       initializer=_lower_priority,
                                       initargs=(self.tuning.parquet_nice,))
        try:
            while self.todo or self.ahead:
                self._decode_ahead()
                unit, future = self.ahead.popleft()
                chunks = _decoded(future) if future is not None else None
                if chunks is None:  # streamed, from this unit on to the end of its row group
                    yield from self._stream_rest(unit)
                    continue
                chunks.reverse()
                while chunks:  # dropped one by one: each freed once the caller is done with it
                    yield chunks.pop()
        finally:
            self.pool.shutdown(cancel_futures=True)

    def _size(self, unit) -> int:
        if isinstance(unit, Piece):
            return self.sizes[unit.group] * unit.rows // self.meta.row_group(unit.group).num_rows
        return self.sizes[unit]

    def _decode_ahead(self) -> None:
        """Start decoding units while fewer than parquet_threads are ahead and their decoded
        bytes fit in parquet_ahead_bytes (one fits always). A row group bigger than
        parquet_group_bytes is replaced by its pieces once cut (not waited for while something
        is ahead), or goes without a future: streamed."""
        t = self.tuning
        waiting = sum(self._size(u) for u, future in self.ahead if future is not None)
        while self.todo and len(self.ahead) < t.parquet_threads:
            unit = self.todo[0]
            if not isinstance(unit, Piece) and self.sizes[unit] > t.parquet_group_bytes:
                pieces = self._pieces(unit, wait=not self.ahead)
                if pieces is _LATER:
                    break
                self.todo.popleft()
                if pieces is None:
                    self.ahead.append((unit, None))
                else:
                    self.todo.extendleft(reversed(pieces))
                continue
            if self.ahead and waiting + self._size(unit) > t.parquet_ahead_bytes:
                break
            self.todo.popleft()
            self.ahead.append((unit, self._submit(unit)))
            waiting += self._size(unit)
        self._plan_next()

    def _submit(self, unit):
        bounds = (self.start, self.stop, self.chunk)
        if isinstance(unit, Piece):
            first = self.first[unit.group] + unit.first
            return self.pool.submit(decode_piece, unit, self.step, first, *bounds)
        return self.pool.submit(decode_group, self.path, self.tuning, self.meta, unit,
                                self.columns, self.step, self.first[unit], *bounds)

    def _pieces(self, g: int, wait: bool):
        """Row group g's pieces; None: stream it; _LATER: not cut yet, not to be waited for."""
        if self.per_row is None:
            return None
        if g not in self.plans:
            self.plans[g] = self.pool.submit(self._plan, g)
        if not wait and not self.plans[g].done():
            return _LATER
        try:
            return self.plans.pop(g).result()
        except Exception:  # noqa: BLE001 - a file the plan cannot read is streamed instead
            return None

    def _plan_next(self) -> None:
        """Start cutting the next big row group while the reader is at the ones before it."""
        if self.per_row is None:
            return
        for unit in self.todo:
            if not isinstance(unit, Piece) and self.sizes[unit] > self.tuning.parquet_group_bytes:
                if unit not in self.plans:
                    self.plans[unit] = self.pool.submit(self._plan, unit)
                return

    def _plan(self, g: int) -> list[Piece] | None:
        n = self.meta.row_group(g).num_rows
        piece_rows = max(1, n * self.tuning.parquet_piece_bytes // max(self.sizes[g], 1))
        pieces = plan_pieces(self.path, self.meta, g, self.per_row, piece_rows)
        if pieces is None:
            return None
        lo, hi = self.start - self.first[g], self.stop - self.first[g]
        return [p for p in pieces if p.first < hi and p.first + p.rows > lo]

    def _stream_rest(self, unit) -> Iterator:
        """The unit's rows to the end of its row group, decoded here one batch at a time; its
        other units are dropped (their decoding cancelled)."""
        g = unit.group if isinstance(unit, Piece) else unit
        lo = self.first[g] + (unit.first if isinstance(unit, Piece) else 0)

        def of_g(u) -> bool:
            return (u.group if isinstance(u, Piece) else u) == g

        for u, future in self.ahead:
            if of_g(u) and future is not None:
                future.cancel()
        self.todo = deque(u for u in self.todo if not of_g(u))
        self.ahead = deque((u, f) for u, f in self.ahead if not of_g(u))
        batches = _stream_group(self.pf, self.path.name, g, self.columns, self.step)
        yield from cut(batches, self.first[g], max(self.start, lo), self.stop)


_LATER = object()


def _lower_priority(nice: int) -> None:
    """Run this pool thread `nice` below the process's priority (Linux only, where a thread has
    a priority of its own): where decoding takes every core, the launching threads run first."""
    if sys.platform != "linux":
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # not allowed here: the thread keeps its priority
        pass


def values_per_row(spec: PipelineSpec) -> dict[str, int] | None:
    """Values a record holds in each column read (1 for the id and a scalar input); None
    where an input's shape after batch is not fixed (its pages cannot be cut by their counts)."""
    shapes = {name: tuple(inp.shape[1:]) for name, inp in spec.inputs.items()}
    if any(isinstance(d, str) for shape in shapes.values() for d in shape):
        return None
    if spec.data.id_field:
        shapes[spec.data.id_field] = ()
    per_row = {name: math.prod(shape) for name, shape in shapes.items()}
    return None if 0 in per_row.values() else per_row


def decoded_bytes(group, spec: PipelineSpec) -> int:
    """About how many bytes a row group's columns take decoded and checked: values times the
    wider of the file's and the input's width (a checked chunk holds its values converted; the
    metadata's sizes are of encoded pages, which a dictionary can make far smaller); and per
    record its ordinal and lengths, and the Python objects of a string id or of a record of
    variable length. group: pyarrow's RowGroupMetaData."""
    id_field = spec.data.id_field
    widths = {name: numpy_dtype(inp.dtype).itemsize for name, inp in spec.inputs.items()}
    if id_field:
        widths[id_field] = 8
    variable = sum(any(isinstance(d, str) for d in inp.shape[1:]) for inp in spec.inputs.values())
    total = group.num_rows * (8 * len(spec.axes) + PY_ARRAY_BYTES * variable)
    for i in range(group.num_columns):
        c = group.column(i)
        name = c.path_in_schema.split(".")[0]
        if name not in widths:
            continue
        width = VALUE_BYTES.get(c.physical_type)
        if width is None:  # strings: their bytes, and a Python str each for an id
            total += c.total_uncompressed_size + PY_STR_BYTES * group.num_rows * (
                name == id_field)
        else:
            total += c.num_values * max(width, widths[name])
    return total


def decode_group(path: Path, tuning: Tuning, meta, group: int, columns: list[str], step: int,
                 first: int, start: int, stop: int, chunk) -> list:
    """The chunks of one row group's rows in [start, stop), on a pool thread, from a reader of
    its own: each decoded record batch of `step` rows and its first row, through chunk(). The
    group's first row is `first`."""
    with open_parquet(path, tuning, meta) as f:
        batches = f.iter_batches(batch_size=step, row_groups=[group], columns=columns)
        return [chunk(rb, row) for rb, row in cut(batches, first, start, stop)]


def decode_piece(piece: Piece, step: int, first: int, start: int, stop: int, chunk) -> list:
    """The chunks of one piece's rows in [start, stop), as decode_group's; its first row in
    the file is `first`."""
    rb = piece.read()
    batches = (rb.slice(lo, step) for lo in range(0, rb.num_rows, step))
    return [chunk(b, row) for b, row in cut(batches, first, start, stop)]


def cut(batches: Iterator, row: int, start: int, stop: int) -> Iterator[tuple]:
    """(record batch, its first row) for the rows in [start, stop) of consecutive record batches,
    the first starting at `row`."""
    for rb in batches:
        lo, hi = max(start - row, 0), min(stop - row, rb.num_rows)
        if hi > lo:
            yield rb.slice(lo, hi - lo), row + lo
        row += rb.num_rows
        if row >= stop:
            return


def pool_chunk(spec: PipelineSpec, file: str, rb, first: int):
    """One chunk as a pool thread leaves it: converted and prechecked, so that the reader's
    thread only checks its ids for duplicates. A chunk that needs its values in Python to say
    what is wrong (nulls, ragged nested lists) is left as it is, (rb, first), for the reader's
    thread to convert: memory stays one chunk of Python values, as the pool runs ahead."""
    c = parquet_candidates(spec, file, rb, first, python_values=False)
    return (rb, first) if c is None else precheck(spec, c)


def _decoded(future) -> list | None:
    try:
        return future.result()
    except Exception:  # noqa: BLE001 - read again by _stream_group, which says what is wrong
        return None


def _stream_group(pf, file: str, group: int, columns: list[str], step: int) -> Iterator:
    """One row group's record batches, decoded one at a time; a damaged page becomes an
    InputError naming the file."""
    batches = pf.iter_batches(batch_size=step, row_groups=[group], columns=columns)
    while True:
        try:
            rb = next(batches)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - ArrowInvalid, OSError, ... from a damaged file
            raise InputError(f"cannot decode the Parquet file: {type(e).__name__}: {e}",
                             where=file) from e
        yield rb
