"""jsonl shards: part-00000.jsonl, one {"id": ..., "<output>": nested lists, ...} per line,
strict JSON (write/strict_json.py: a non-finite float as "NaN", "Infinity", "-Infinity")."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from graphrun.base.errors import OutputError
from graphrun.write.sinks.ids import plain
from graphrun.write.strict_json import strict_dumps
from graphrun.base.tuning import Tuning
from graphrun.base.nofollow import open_file


class JsonlSink:
    """One JSON object per record, written as it comes: any first bytes of the file are the
    shard's first rows, so checkpoint() only flushes and rows= appends to the file."""

    suffix = ".jsonl"
    uses_row_pool = False
    hashes_ahead = False

    def __init__(self, out_dir: Path, stem: str, rows_per_file: int, shapes: dict,
                 tuning: Tuning, pool=None, rows: int = 0):
        self.tmp = out_dir / f".{stem}.jsonl.tmp"
        self.name = f"{stem}.jsonl"
        self.logs: list[Path] = []  # its temp file alone holds the rows so far
        self.f = open_file(self.tmp, "a" if rows else "w", encoding="utf-8", newline="\n")

    @staticmethod
    def check(outputs: dict) -> None:
        if "id" in outputs:
            raise OutputError("output 'id' clashes with the record id in jsonl; rename it")

    def add(self, ids, outputs: dict) -> None:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        for i, rid in enumerate(ids):
            row = {"id": plain(rid)}
            row.update((name, v[i].tolist()) for name, v in outputs.items())
            self.f.write(strict_dumps(row, separators=(",", ":")) + "\n")

    def checkpoint(self) -> list[tuple[Path, int]]:
        self.f.flush()
        return [(self.tmp, os.fstat(self.f.fileno()).st_size)]

    def leave(self) -> None:
        self.f.close()

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)

    def finish(self) -> list[tuple[Path, str]]:
        self.f.close()
        return [(self.tmp, self.name)]
