"""Parquet input: a column per input (nested lists for the axes after batch), and one of ids.

Read through pyarrow alone. pyarrow decodes a column chunk on one thread, releasing the GIL
meanwhile: so up to tuning.parquet_threads row groups are decoded at once, each whole on a pool
thread (its column chunks fetched in one read, pre_buffer), which also converts and checks its
chunks (see pool_chunk), at most tuning.parquet_ahead_bytes ahead of the caller, in file order.
A row group whose decoded bytes pass tuning.parquet_group_bytes (a file written as one giant
row group) is not decoded whole: it is streamed when its turn comes, on the caller's thread,
with iter_batches over a buffered stream, so pyarrow reads and decodes its pages a batch at a
time and memory stays about one chunk (its decoding then runs on that one thread, not ahead on
the pool). So is the rest of a row group whose decoding failed on the pool: a damaged page
raises, naming the file, after the chunks before it. Columns become records in
parquet_columns.py.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow.parquet as pq

from graphrun.base.errors import InputError
from graphrun.read.prompts import Prompts
from graphrun.read.formats.parquet_columns import check_schema, id_values, parquet_candidates
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

    def ids(self) -> Iterator[tuple[np.ndarray, np.ndarray | list]]:
        """(ordinals, ids) of the records whose id is not null, a batch of the id column at a
        time: that column alone is read (stream.job_duplicates)."""
        pf, row = self._open(), 0
        for g in range(pf.metadata.num_row_groups):
            for rb in _stream_group(pf, self.path.name, g, [self.spec.data.id_field],
                                    self.tuning.array_chunk_rows):
                col, rows = rb.column(0), np.arange(row, row + rb.num_rows, dtype=np.int64)
                row += rb.num_rows
                if col.null_count:
                    keep = col.is_valid().to_numpy(zero_copy_only=False)
                    col, rows = col.filter(keep), rows[keep]
                yield rows, id_values(col)

    def _open(self) -> pq.ParquetFile:
        return open_parquet(self.path, self.tuning)


def open_parquet(path: Path, tuning: Tuning, metadata=None, whole: bool = False
                 ) -> pq.ParquetFile:
    """whole: a row group decoded at once, its column chunks fetched in one read (pre_buffer);
    else pages read a little at a time through a buffer (a giant row group streamed)."""
    try:
        if whole:
            return pq.ParquetFile(path, metadata=metadata, pre_buffer=True)
        return pq.ParquetFile(path, metadata=metadata, pre_buffer=False,
                              buffer_size=tuning.parquet_buffer_bytes)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for unreadable files
        raise InputError(f"cannot read the Parquet file: {e}", where=path.name) from e


class _Decoding:
    """One pass over rows [start, stop): row groups move from `todo` to `ahead` as they start
    decoding on the pool (or are marked to be streamed), and leave `ahead` in file order as
    their chunks are handed out."""

    def __init__(self, reader: ParquetReader, pf, spans: list[tuple[int, int]], start: int,
                 stop: int):
        self.path, self.spec, self.tuning = reader.path, reader.spec, reader.tuning
        self.pf, self.meta, self.start, self.stop = pf, pf.metadata, start, stop
        id_field = self.spec.data.id_field
        # a text column is read in place of the inputs it is tokenized into (read/text.py)
        text = self.spec.data.text
        self.columns = ((Prompts(self.spec).fields if text else list(self.spec.inputs))
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
        self.chunk = functools.partial(pool_chunk, self.spec, self.path.name)
        self.todo, self.ahead = deque(self.first), deque()  # ahead: (group, future or None)

    def chunks(self) -> Iterator:
        self.pool = ThreadPoolExecutor(self.tuning.parquet_threads, thread_name_prefix="parquet",
                                       initializer=_lower_priority,
                                       initargs=(self.tuning.parquet_nice,))
        try:
            while self.todo or self.ahead:
                self._decode_ahead()
                g, future = self.ahead.popleft()
                chunks = _decoded(future) if future is not None else None
                if chunks is None:  # streamed here: too big to decode whole, or it failed
                    batches = _stream_group(self.pf, self.path.name, g, self.columns, self.step)
                    yield from cut(batches, self.first[g], self.start, self.stop)
                    continue
                chunks.reverse()
                while chunks:  # dropped one by one: each freed once the caller is done with it
                    yield chunks.pop()
        finally:
            self.pool.shutdown(cancel_futures=True)

    def _decode_ahead(self) -> None:
        """Start decoding row groups while fewer than parquet_threads are ahead and their
        decoded bytes fit in parquet_ahead_bytes (one fits always). One bigger than
        parquet_group_bytes goes without a future: streamed in its turn."""
        t = self.tuning
        waiting = sum(self.sizes[g] for g, future in self.ahead if future is not None)
        while self.todo and len(self.ahead) < t.parquet_threads:
            g = self.todo[0]
            if self.sizes[g] > t.parquet_group_bytes:
                self.ahead.append((self.todo.popleft(), None))
                continue
            if self.ahead and waiting + self.sizes[g] > t.parquet_ahead_bytes:
                break
            self.todo.popleft()
            self.ahead.append((g, self.pool.submit(
                decode_group, self.path, self.tuning, self.meta, g, self.columns, self.step,
                self.first[g], self.start, self.stop, self.chunk)))
            waiting += self.sizes[g]


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
    group's first row is `first`. use_threads off: the pool's threads are the parallelism, one
    row group each."""
    with open_parquet(path, tuning, meta, whole=True) as f:
        batches = f.iter_batches(batch_size=step, row_groups=[group], columns=columns,
                                 use_threads=False)
        return [chunk(rb, row) for rb, row in cut(batches, first, start, stop)]


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
            # named by its row group and rows: which records were lost, and where to look
            first = sum(pf.metadata.row_group(g).num_rows for g in range(group))
            last = first + pf.metadata.row_group(group).num_rows - 1
            raise InputError(f"cannot decode row group {group} (rows {first} to {last}) of the "
                             f"Parquet file: {type(e).__name__}: {e}; the file is damaged "
                             "there: write it again", where=file) from e
        yield rb
