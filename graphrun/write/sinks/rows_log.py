"""What a sink keeps beside an open shard's temp files, to reopen them after a crash: the ids
of its rows (npy keeps them in memory until the shard is finished) or the rows themselves
(parquet: a file without its footer cannot be read back). Appended at each checkpoint, never
rewritten, so the bytes an open journal line committed stay as they were; named
`.part-00000.<suffix>.rows.tmp` (journal.shard_number) and deleted when the shard is finished.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from graphrun.write.sinks.ids import plain


def log_path(out_dir: Path, stem: str, suffix: str) -> Path:
    return out_dir / f".{stem}.{suffix}.rows.tmp"


class _Log:
    def __init__(self, path: Path):
        self.path = path
        self._f = None
        self.count = 0  # rows appended (or found on reopening)

    def _file(self):
        if self._f is None:
            self._f = open(self.path, "ab")
        return self._f

    def size(self) -> int:
        """Bytes appended so far, all of them handed to the file (for a commit's fsync)."""
        if self._f is None:
            return self.path.stat().st_size if self.path.exists() else 0
        self._f.flush()
        return os.fstat(self._f.fileno()).st_size

    def close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            f.close()

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


class IdsLog(_Log):
    """Ids, one JSON value a line."""

    def append(self, ids: list) -> None:
        if ids:
            self._file().write("".join(json.dumps(plain(x)) + "\n" for x in ids).encode())
            self.count += len(ids)

    def read(self) -> list:
        ids = [json.loads(line) for line in self.path.read_bytes().splitlines()]
        self.count = len(ids)
        return ids


class RowsLog(_Log):
    """Rows in frames: a JSON head (ids, output names, dtypes), then per output the records'
    shapes [n, ndim] and their values, flat (np.save each; records of one output may differ
    in shape, and text records in width)."""

    def append(self, ids: list, records: dict[str, list]) -> None:
        if not ids:
            return
        f = self._file()
        arrays = {name: [np.asarray(r) for r in rs] for name, rs in records.items()}
        dtypes = {}
        for name, rs in arrays.items():
            kinds = [a.dtype.str for a in rs]
            dtypes[name] = kinds[0] if len(set(kinds)) == 1 else kinds
        head = {"ids": [plain(x) for x in ids], "names": list(arrays), "dtypes": dtypes}
        np.save(f, np.frombuffer(json.dumps(head).encode(), np.uint8), allow_pickle=False)
        for rs in arrays.values():
            np.save(f, np.array([a.shape for a in rs], np.int64).reshape(len(rs), -1)
                    if rs[0].ndim else np.zeros((len(rs), 0), np.int64), allow_pickle=False)
            np.save(f, np.concatenate([a.ravel() for a in rs]), allow_pickle=False)
        self.count += len(ids)

    def read(self):
        """(ids, {name: records}) per frame, in order; records as the sink was given them:
        numpy scalars for a [batch] output, arrays otherwise."""
        self.count = 0
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            while f.tell() < size:
                head = json.loads(np.load(f, allow_pickle=False).tobytes())
                records = {}
                for name in head["names"]:
                    shapes, values = np.load(f, allow_pickle=False), np.load(f, allow_pickle=False)
                    kinds = head["dtypes"][name]
                    kinds = kinds if isinstance(kinds, list) else [kinds] * len(shapes)
                    ends = np.cumsum([int(np.prod(s)) for s in shapes])
                    records[name] = [
                        piece.astype(kind).reshape(shape) if len(shape) else piece.astype(kind)[0]
                        for piece, shape, kind in zip(np.split(values, ends[:-1]),
                                                      map(tuple, shapes), kinds)]
                self.count += len(head["ids"])
                yield head["ids"], records
