""".npz input: one array per input (and one of ids, named by data.id_field), all [N, ...].
Stored members are memory-mapped; deflated ones decompressed front to back (one chunk in
memory)."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from typing import Iterator

import numpy as np

from graphrun.base.errors import InputError
from graphrun.read.formats.dense import (check_array, dense_chunks, npy_too_short,
                                         read_npy_header)
from graphrun.read.records import Candidates
from graphrun.spec.keys import PipelineSpec
from graphrun.base.tuning import Tuning

SKIP_BYTES = 16 << 20  # a deflated member's rows before `start` are skipped this many at a time


class NpzReader:
    suffix = ".npz"

    def __init__(self, path: Path, spec: PipelineSpec, tuning: Tuning):
        self.path, self.spec, self.tuning = path, spec, tuning

    def count(self) -> int:
        """Records in the file, from the header of the first input's array."""
        with self._zip() as zf, zf.open(next(iter(self.spec.inputs)) + ".npy") as f:
            shape, _, _ = read_npy_header(f, self.path.name)
        return shape[0] if shape else 0

    def check(self) -> None:
        """Whole-file problems: arrays missing, of other lengths, shapes or dtypes."""
        with self._zip() as zf:
            self._arrays(zf)

    def chunks(self, start: int, stop: int | None) -> Iterator[Candidates]:
        with self._zip() as zf:
            arrays, ids, n = self._arrays(zf)
            yield from dense_chunks(self.spec, self.path.name, arrays, ids, n, start, stop,
                                    self.tuning)

    def _zip(self) -> zipfile.ZipFile:
        try:
            return zipfile.ZipFile(self.path)
        except (OSError, zipfile.BadZipFile) as e:
            raise InputError(f"cannot read the .npz file: {e}", where=self.path.name) from e

    def _arrays(self, zf: zipfile.ZipFile) -> tuple[dict, np.ndarray | None, int]:
        """(input arrays, the ids or None, records), each checked."""
        path, spec, id_field = self.path, self.spec, self.spec.data.id_field
        members = {n[:-4]: n for n in zf.namelist() if n.endswith(".npy")}
        wanted = list(spec.inputs) + ([id_field] if id_field else [])
        missing = [n for n in wanted if n not in members]
        if missing:
            raise InputError(f"array {missing[0]!r} is missing (arrays in the file: "
                             f"{', '.join(members) or 'none'})", where=path.name)
        arrays = {n: npz_member(path, zf, members[n]) for n in wanted}
        counts = {n: a.shape[0] if a.shape else None for n, a in arrays.items()}
        if len(set(counts.values())) != 1 or None in counts.values():
            raise InputError(f"arrays must all have the same number of records (first "
                             f"dimension): {counts}", where=path.name)
        for name in spec.inputs:
            check_array(spec, name, arrays[name], f"{path.name}[{name}]")
        ids = arrays.pop(id_field) if id_field else None
        if ids is not None and (ids.ndim != 1 or ids.dtype.kind not in "iuUS"):
            raise InputError(f"ids {id_field!r} must be a 1-d array of integers or strings "
                             f"(one scalar per record), got {ids.dtype} of shape {ids.shape}",
                             where=path.name)
        return arrays, ids, counts[wanted[0]]


def npz_member(path: Path, zf: zipfile.ZipFile, member: str):
    """A stored member as a memory map; a deflated one as rows read front to back."""
    info = zf.getinfo(member)
    if info.compress_type != zipfile.ZIP_STORED:
        return DeflatedRows(zf.open(member), f"{path.name}[{member}]")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)  # zip local file header; the data follow its name and extra field
        if header[:4] != b"PK\x03\x04":
            raise InputError(f"corrupt .npz member {member!r}", where=path.name)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        data_start = info.header_offset + 30 + name_len + extra_len
        f.seek(data_start)
        shape, fortran, dtype = read_npy_header(f, f"{path.name}[{member}]")
        offset = f.tell()
    if dtype.hasobject:
        raise InputError(f"{member}: object arrays are not supported", where=path.name)
    # the member's own bytes, not the file's: past them the map would read the zip's directory
    short = npy_too_short(shape, dtype, data_start + info.file_size - offset, "the member")
    if short:
        raise InputError(f"{member}: {short}: the file is truncated or damaged; write it again",
                         where=path.name)
    if int(np.prod(shape)) == 0:
        return np.empty(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape,
                     order="F" if fortran else "C")


class DeflatedRows:
    """Rows of a compressed .npz member, decompressed front to back: one chunk in memory."""

    def __init__(self, file, where: str):
        self.file, self.where = file, where
        self.shape, fortran, self.dtype = read_npy_header(file, where)
        if fortran and len(self.shape) > 1:
            raise InputError("a compressed Fortran-ordered array cannot be read row by row; "
                             "save it C-ordered or with np.savez (uncompressed)", where=where)
        if self.dtype.hasobject:
            raise InputError("object arrays are not supported", where=where)
        self.ndim = len(self.shape)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:]))
        self.row = 0  # next row the file will give

    def __getitem__(self, rows: slice) -> np.ndarray:
        """Rows [rows.start, rows.stop), at or after the last rows read."""
        assert rows.start >= self.row, "compressed rows are read front to back"
        while self.row < rows.start:  # skip in bounded steps
            step = min(rows.start - self.row, max(1, SKIP_BYTES // max(self.row_bytes, 1)))
            self.file.read(step * self.row_bytes)
            self.row += step
        n = rows.stop - rows.start
        data = self.file.read(n * self.row_bytes)
        if len(data) != n * self.row_bytes:
            raise InputError("the compressed array ends early (the file is truncated)",
                             where=self.where)
        self.row = rows.stop
        return np.frombuffer(data, self.dtype).reshape((n,) + tuple(self.shape[1:]))
