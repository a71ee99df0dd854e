"""A JSONL input of a --ray run: a Ray Datasource of the file's lines, each with its record
ordinal and its line number, parsed by the actors as one process parses them (jsonl_parse.py).

Ray's own read_json parses in its read task with pyarrow or pandas: one malformed line fails the
whole read (so data.on_bad_record: skip could not skip it), a missing field or a string among
numbers becomes a column no record check sees, and a reject could only say "[row 7]". Here the
read tasks only cut the file into lines (byte spans found by one pass on the driver, which also
counts the lines and records before each span), and each actor's batch goes through the same
parse and checks as a block of the one-process reader, with the file's line numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphrun.read.formats.jsonl_lines import lines_of
from graphrun.scale.ray.columns import LINE_NO, LINE_TEXT, ORDINAL

SPAN_BYTES = 32 << 20  # a read task's share of a big file, at most
BLOCK_BYTES = 4 << 20  # lines per block a read task yields


@dataclass(frozen=True)
class Span:
    """Whole lines of the file: [offset, offset + size) bytes; the first is line `lineno`
    (1-based) and, if not blank, record `ordinal`. offset None: the whole file through
    lines_of (a file whose lines end in CR alone, read as one span)."""

    offset: int | None
    size: int
    lineno: int
    ordinal: int
    records: int


def line_spans(path: Path, span_bytes: int) -> list[Span]:
    """The file cut at line ends into spans of about span_bytes, in one pass."""
    spans = []
    with open(path, "rb") as f:
        lines = lines_of(f)  # a leading byte order mark is skipped here
        if lines is not f:  # CR-only line ends: the reader's own translation, one span
            records = sum(not line.isspace() for block in iter(lambda: lines.readlines(
                BLOCK_BYTES), []) for line in block)
            return [Span(None, os.fstat(f.fileno()).st_size, 1, 0, records)]
        offset, lineno, ordinal = f.tell(), 1, 0
        size = n_lines = records = 0
        while block := f.readlines(BLOCK_BYTES):
            size += sum(map(len, block))
            n_lines += len(block)
            records += sum(not line.isspace() for line in block)
            if size >= span_bytes:
                spans.append(Span(offset, size, lineno, ordinal, records))
                offset, lineno, ordinal = offset + size, lineno + n_lines, ordinal + records
                size = n_lines = records = 0
        if size:
            spans.append(Span(offset, size, lineno, ordinal, records))
    return spans


def span_lines(path: Path, span: Span):
    """Blocks of (lines, their line numbers, their ordinals) of the span's non-blank lines."""
    with open(path, "rb") as f:
        if span.offset is None:
            reader = lines_of(f)
            more = iter(lambda: reader.readlines(BLOCK_BYTES), [])
        else:
            f.seek(span.offset)
            left = span.size

            def read_block():
                nonlocal left
                got = f.readlines(min(BLOCK_BYTES, left)) if left > 0 else []
                left -= sum(map(len, got))
                return got

            more = iter(read_block, [])
        lineno, ordinal = span.lineno, span.ordinal
        for block in more:
            rows = [i for i, line in enumerate(block) if not line.isspace()]
            yield ([block[i] for i in rows], [lineno + i for i in rows],
                   list(range(ordinal, ordinal + len(rows))))
            lineno += len(block)
            ordinal += len(rows)


def jsonl_lines_source(path: Path, span_bytes: int | None = None):
    """A Ray Datasource of path's non-blank lines: ORDINAL, LINE_NO and LINE_TEXT (the bytes).
    span_bytes: a read task's bytes (None: the file over Ray's parallelism, 1 to 32 MiB)."""
    import pyarrow as pa
    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata

    # given with every read task: Dataset.columns() (dataset_map asks) would otherwise run a
    # read for the first block and cancel the rest in flight, a race that can abort the driver
    # in Ray's own checks
    schema = pa.schema([(ORDINAL, pa.int64()), (LINE_NO, pa.int64()), (LINE_TEXT, pa.binary())])

    def read(span: Span):
        for lines, linenos, ordinals in span_lines(path, span):
            if lines:
                yield pa.table([pa.array(ordinals, pa.int64()), pa.array(linenos, pa.int64()),
                                pa.array(lines, pa.binary())], schema=schema)

    class JsonlLines(Datasource):
        def estimate_inmemory_data_size(self) -> int:
            return path.stat().st_size

        def get_read_tasks(self, parallelism: int, per_task_row_limit=None,
                           data_context=None) -> list:
            share = -(-path.stat().st_size // max(parallelism, 1))
            spans = line_spans(path, span_bytes or min(max(share, 1 << 20), SPAN_BYTES))
            return [ReadTask(lambda s=s: read(s),
                             BlockMetadata(num_rows=s.records, size_bytes=s.size,
                                           exec_stats=None, input_files=(str(path),)),
                             schema=schema)
                    for s in spans if s.records]

        def get_name(self) -> str:
            return "graphrun JSONL lines"

    return JsonlLines()


def line_candidates(spec, file: str, table):
    """A Ray batch of line rows as the one-process reader's Candidates: parsed, located by the
    file's line numbers, numbered by the file's record ordinals."""
    from graphrun.read.formats.jsonl_parse import jsonl_candidates

    ordinals = table.column(ORDINAL).to_numpy().astype(np.int64)
    c = jsonl_candidates(spec, file, table.column(LINE_TEXT).to_pylist(),
                         table.column(LINE_NO).to_pylist(), 0)
    c.indices = ordinals[c.indices]  # positions in the batch -> the file's ordinals
    for r in c.rejects:
        r.index = int(ordinals[r.index])
        if spec.data.id_field is None:
            r.id = r.index
    return c
