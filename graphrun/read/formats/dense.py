"""What the dense formats (.npy, .npz) share: whole-array checks, rows read chunk by chunk from
memory-mapped (or front-to-back decompressed) arrays, ids as int64 where they can be.

Memory stays at about one chunk whatever the file's size: a mapped chunk's pages are released
once it is read (see release_rows), and a chunk is capped in records too, as a record may also
cost Python objects (a string id).
"""

from __future__ import annotations

import functools
import mmap
from typing import Iterator

import numpy as np

from graphrun.base.errors import InputError
from graphrun.read.checks import shape_problem
from graphrun.read.records import Candidates, Field, RowWhere
from graphrun.spec.keys import PipelineSpec
from graphrun.base.tuning import Tuning


def read_npy_header(f, where: str) -> tuple[tuple, bool, np.dtype]:
    """(shape, fortran order, dtype) of the .npy array whose header starts at f's position."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(f)
        if version == (2, 0):
            return np.lib.format.read_array_header_2_0(f)
    except ValueError as e:
        raise InputError(f"not a valid .npy array: {e}", where=where) from e
    raise InputError(f".npy format version {version} is not supported (1.0 and 2.0 are)",
                     where=where)


def npy_too_short(shape: tuple, dtype: np.dtype, held: int, holder: str) -> str:
    """Why `held` bytes after a .npy header cannot be its array ("" where they can); holder:
    what holds them (the file, an .npz member)."""
    needed = dtype.itemsize * int(np.prod(shape))
    return (f"its header says {list(shape)} {dtype} ({needed} bytes) but {holder} holds "
            f"{max(held, 0)} bytes after it" if held < needed else "")


def check_array(spec: PipelineSpec, name: str, array, where: str) -> None:
    """Whole-file problems of a dense array: every record would fail, so they are errors even
    with on_bad_record: skip."""
    inp = spec.inputs[name]
    if array.dtype.kind not in "biuf":
        raise InputError(f"{name}: dtype {array.dtype} is not numeric", where=where)
    if array.dtype.kind == "b" and inp.dtype != "bool":
        raise InputError(f"{name}: booleans where {inp.dtype} numbers are expected", where=where)
    if array.ndim == 0:
        raise InputError(f"{name}: a 0-d array has no records; expected [N, ...]", where=where)
    reason, _ = shape_problem(name, inp, tuple(array.shape[1:]), spec)
    if reason:
        raise InputError(f"{reason} (array shape {list(array.shape)})", where=where)


def dense_chunks(spec: PipelineSpec, file: str, arrays: dict, ids, n_rows: int, start: int,
                 stop: int | None, tuning: Tuning) -> Iterator[Candidates]:
    """Chunks of rows [start, stop) of arrays that all have n_rows rows."""
    stop = n_rows if stop is None else min(stop, n_rows)
    row_bytes = sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in arrays.values())
    step = min(tuning.array_chunk_rows, max(1, tuning.array_chunk_bytes // max(row_bytes, 1)))
    mapped = [a for a in [*arrays.values(), ids] if isinstance(a, np.memmap)]
    behind = None  # the rows of the chunk before the last one handed out
    for lo in range(start, stop, step):
        hi = min(lo + step, stop)
        rows = np.arange(lo, hi, dtype=np.int64)  # read-only from here on: shared
        problems: dict[int, str] = {}
        yield Candidates(
            indices=rows,
            ids=chunk_ids(ids[lo:hi], problems) if ids is not None else None,
            where=RowWhere(file, rows),
            fields={name: Field(dense=np.asarray(a[lo:hi])) for name, a in arrays.items()},
            problems=problems,
        )
        # Records of the file's dtype stay views of the mapping until they are padded into
        # the host slots (no copy in between). The consumer asks for chunk k+1 only once it
        # has staged every row of chunk k-1 (batches are regrouped across one chunk edge at
        # most), so that chunk's pages are released now, one chunk behind.
        if behind is not None:
            for a in mapped:
                release_rows(a, *behind)
        behind = (lo, hi)


def release_rows(array: np.memmap, lo: int, hi: int) -> None:
    """Unmap the pages of rows [lo, hi) of a memory-mapped array from this process.

    A mapped page that was read stays in the process (and in its RSS) until it is unmapped, so
    one pass over a memory-mapped file grows RSS to the file's size. MADV_DONTNEED on a
    read-only shared file mapping only drops the pages from this process: the data stay in the
    page cache, and reading them again maps them again (the same bytes). Rows of a Fortran-
    ordered array are not contiguous: those are left mapped."""
    mm = getattr(array, "_mmap", None)  # numpy's mmap.mmap under a np.memmap
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    if array.ndim > 1 and not array.flags.c_contiguous:
        return
    row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:]))
    # np.memmap maps from `offset` rounded down to the allocation granularity
    first = array.offset % mmap.ALLOCATIONGRANULARITY + lo * row_bytes
    end = array.offset % mmap.ALLOCATIONGRANULARITY + hi * row_bytes
    if end > len(mm):  # not the layout assumed above: leave it
        return
    first -= first % mmap.PAGESIZE  # madvise works on whole pages; the page straddling
    end -= end % mmap.PAGESIZE  # `end` is released with the next chunk
    if end > first:
        _dont_need(mm, first, end - first)


def _dont_need(mm: mmap.mmap, first: int, length: int) -> None:
    """madvise(MADV_DONTNEED) on bytes [first, first + length) of a mapping. mmap.madvise holds
    the GIL while the kernel unmaps the pages, stalling the replay's other Python threads:
    libc's madvise called through ctypes releases it. mmap.madvise where ctypes cannot."""
    madvise = _libc_madvise()
    if madvise is not None:
        base = np.frombuffer(mm, np.uint8).ctypes.data  # the mapping's first byte
        if madvise(base + first, length, mmap.MADV_DONTNEED) == 0:
            return
    mm.madvise(mmap.MADV_DONTNEED, first, length)


@functools.lru_cache(maxsize=1)
def _libc_madvise():
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):  # no libc symbol table (not Linux/macOS)
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def chunk_ids(ids: np.ndarray, problems: dict[int, str]) -> np.ndarray | list:
    """A chunk of an id array: integers as int64 (no Python int per record), strings as a list
    of str. uint64 ids past the int64 range stay Python ints (the writer stores such a shard's
    ids as strings, as it always did). A bytes id that is not UTF-8 is None, with a problem."""
    if ids.dtype.kind == "S":  # decoded as UTF-8: numpy's astype(str) raised on any non-ASCII
        return [_utf8_id(p, b, problems) for p, b in enumerate(ids.tolist())]
    if ids.dtype.kind in "iu":
        return int64_ids(np.asarray(ids))
    return ids.tolist()


def _utf8_id(p: int, raw: bytes, problems: dict[int, str]) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        problems[p] = (f"id {raw!r} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte "
                       f"{e.start}): store the ids as text (a numpy str array) or integers")
        return None


def int64_ids(ids: np.ndarray) -> np.ndarray | list:
    if ids.dtype.kind == "u" and ids.dtype.itemsize == 8 and len(ids) and ids.max() >= 2**63:
        return ids.tolist()
    return ids.astype(np.int64)
