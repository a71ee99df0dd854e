"""JSONL input: one JSON object per line, a field per input (and the id field), blank lines
skipped. Read in blocks of whole lines (tuning.jsonl_chunk_bytes), each parsed and converted
together (jsonl_parse.py); for a big file on a machine with cores to spare, in child processes
(jsonl_workers.py)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Iterator

from graphrun.base.errors import InputError
from graphrun.read.formats.jsonl_lines import lines_of
from graphrun.read.formats.jsonl_parse import line_ids, parse_block
from graphrun.read.formats.jsonl_workers import parse_blocks
from graphrun.read.checks import Prechecked
from graphrun.read.records import Candidates
from graphrun.spec.keys import PipelineSpec
from graphrun.base.tuning import Tuning


class JsonlReader:
    suffix = ".jsonl"

    def __init__(self, path: Path, spec: PipelineSpec, tuning: Tuning):
        self.path, self.spec, self.tuning = path, spec, tuning

    def count(self) -> int:
        """Records in the file: its non-blank lines."""
        total = 0
        with _open(self.path) as f:
            lines = lines_of(f)  # CR-only line ends counted as lines too
            while block := lines.readlines(1 << 20):
                total += sum(not line.isspace() for line in block)
        return total

    def check(self) -> None:
        """A JSONL file has no schema of its own: every record is checked as it is read."""
        _open(self.path).close()

    def chunks(self, start: int, stop: int | None) -> Iterator[Candidates | Prechecked]:
        """Each block's records: parsed here, or in child processes for a big file."""
        with _open(self.path) as f:
            size = os.fstat(f.fileno()).st_size
            blocks = _blocks(f, self.path.name, start, stop, self.tuning.jsonl_chunk_bytes)
            yield from parse_blocks(self.spec, size, blocks,
                                    functools.partial(parse_block, self.spec), self.tuning)

    def ids(self) -> Iterator[tuple[list[int], list]]:
        """(ordinals, ids) block by block of the records whose id field parses: the lines
        parsed for their ids only (stream.job_duplicates)."""
        with _open(self.path) as f:
            for _, lines, _, first in _blocks(f, self.path.name, 0, None,
                                              self.tuning.jsonl_chunk_bytes):
                yield line_ids(lines, self.spec.data.id_field, first)


def _blocks(f, file: str, start: int, stop: int | None, block_bytes: int) -> Iterator[tuple]:
    """(file, lines, their line numbers, the first's ordinal) of consecutive records, about
    block_bytes of whole lines at a time. A UTF-8 byte order mark opening the file is
    skipped; a file whose lines end in CR alone (old Mac) is read as if they ended in LF."""
    lineno, index = 1, 0  # line number of the block's first line, ordinal of its first record
    f = lines_of(f)
    while lines := f.readlines(block_bytes):  # whole lines, about this many bytes
        rows = [i for i, line in enumerate(lines) if not line.isspace()]  # blank: no record
        lo = max(start - index, 0)  # records before start are counted, not parsed
        hi = len(rows) if stop is None else min(stop - index, len(rows))
        if hi > lo:
            yield (file, [lines[i] for i in rows[lo:hi]], [lineno + i for i in rows[lo:hi]],
                   index + lo)
        index += len(rows)
        lineno += len(lines)
        if stop is not None and index >= stop:
            break


def _open(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot read the input file: {e.strerror}", where=str(path)) from e
