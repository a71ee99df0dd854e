"""Parquet row groups decoded in parallel, piece by piece: one thread per piece of rows.

pyarrow decodes a column chunk on one thread from its first page to its last, so a file with one
big row group (pq.write_table and pandas write up to 1Mi rows in one) decodes at one thread's
rate: 330k records of 256 floats a second on the H200's host, an eighth of the MLP's replay
rate. Nothing in pyarrow reads a row range inside a row group, so this module cuts the row
group itself:

    plan_pieces   walks each column chunk's page headers (Thrift, read here) and picks pages
                  where rows of a fixed number of values start, a piece about every
                  `piece_rows` rows
    read_piece    hands pyarrow, per column, a file made of the chunk's dictionary page, the
                  piece's data pages and a footer written here that describes just those
                  pages as a row group; decodes it; checks that it held the rows it should
                  (every row of that many values where the pages meet); cuts the piece's rows

A file the plan cannot cut (encrypted, an unknown codec, a column of varying values per row)
gets None from plan_pieces and is read as before; a piece whose rows do not come out as planned
raises PieceMismatch, and the caller reads the row group from that piece on as before. Both
only cost speed: the records read are the same.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from typing import Iterator

import numpy as np


# ---- Thrift compact protocol: parquet.thrift's structs as {field id: (type, value)} ----------
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = \
    range(13)


class ThriftError(ValueError):
    pass


class _Reader:
    def __init__(self, data: bytes | memoryview, pos: int = 0):
        self.data, self.pos = data, pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise ThriftError("truncated")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 70:
                raise ThriftError("varint too long")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ThriftError("truncated")
        out = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return out

    def value(self, t: int):
        if t in (_TRUE, _FALSE):  # an element of a list (a field's bool is in its header)
            return self.byte() == _TRUE
        if t == _BYTE:
            return self.byte()
        if t in (_I16, _I32, _I64):
            return self.zigzag()
        if t == _DOUBLE:
            return struct.unpack("<d", self.take(8))[0]
        if t == _BINARY:
            return self.take(self.varint())
        if t in (_LIST, _SET):
            head = self.byte()
            size, et = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            return (et, [self.value(et) for _ in range(size)])
        if t == _STRUCT:
            return self.struct()
        if t == _MAP:
            size = self.varint()
            kv = self.byte() if size else 0
            return (kv, [(self.value(kv >> 4), self.value(kv & 0x0F)) for _ in range(size)])
        raise ThriftError(f"unknown type {t}")

    def struct(self) -> dict:
        fields, fid = {}, 0
        while True:
            head = self.byte()
            t = head & 0x0F
            if t == _STOP:
                return fields
            delta = head >> 4
            fid = fid + delta if delta else self.zigzag()
            fields[fid] = (t, t == _TRUE) if t in (_TRUE, _FALSE) else (t, self.value(t))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def _write_value(t: int, v, out: bytearray) -> None:
    if t in (_TRUE, _FALSE):
        out.append(_TRUE if v else _FALSE)
    elif t == _BYTE:
        out.append(v & 0xFF)
    elif t in (_I16, _I32, _I64):
        out += _zigzag(v)
    elif t == _DOUBLE:
        out += struct.pack("<d", v)
    elif t == _BINARY:
        out += _varint(len(v)) + v
    elif t in (_LIST, _SET):
        et, items = v
        out.append((len(items) << 4 | et) if len(items) < 15 else (0xF0 | et))
        if len(items) >= 15:
            out += _varint(len(items))
        for item in items:
            _write_value(et, item, out)
    elif t == _STRUCT:
        _write_struct(v, out)
    elif t == _MAP:
        kv, items = v
        out += _varint(len(items))
        if items:
            out.append(kv)
        for k, x in items:
            _write_value(kv >> 4, k, out)
            _write_value(kv & 0x0F, x, out)
    else:
        raise ThriftError(f"unknown type {t}")


def _write_struct(fields: dict, out: bytearray) -> None:
    last = 0
    for fid in sorted(fields):
        t, v = fields[fid]
        if t in (_TRUE, _FALSE):
            t = _TRUE if v else _FALSE
        if 0 < fid - last <= 15:
            out.append((fid - last) << 4 | t)
        else:
            out.append(t)
            out += _zigzag(fid)
        last = fid
        if t not in (_TRUE, _FALSE):
            _write_value(t, v, out)
    out.append(_STOP)


def encode_struct(fields: dict) -> bytes:
    out = bytearray()
    _write_struct(fields, out)
    return bytes(out)


def decode_struct(data: bytes | memoryview, pos: int = 0) -> tuple[dict, int]:
    """(the struct, the position after it)."""
    r = _Reader(data, pos)
    return r.struct(), r.pos


# ---- the footer and the page headers ------------------------------------------------------
# parquet.thrift's codes
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3
_CODECS = {0: None, 1: "snappy", 2: "gzip", 4: "brotli", 6: "zstd", 7: "lz4_raw"}
_RLE = 3  # a data page v1's level encoding: the RLE / bit-packed hybrid


def read_footer(f) -> dict:
    """The file's FileMetaData; ThriftError where the file is not a plain Parquet file."""
    size = os.fstat(f.fileno()).st_size
    f.seek(size - 8)
    tail = f.read(8)
    if len(tail) != 8 or tail[4:] != b"PAR1":
        raise ThriftError("not a plain Parquet file (encrypted or damaged)")
    length = struct.unpack("<I", tail[:4])[0]
    if length + 12 > size:
        raise ThriftError("footer longer than the file")
    f.seek(size - 8 - length)
    return decode_struct(f.read(length))[0]


@dataclass
class Page:
    offset: int  # in the file, its header's first byte
    size: int  # header and body
    kind: int  # _DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2
    values: int  # levels (rows of a column of scalars); 0 for a dictionary page
    body: int  # bytes of the body, as stored
    raw: int  # bytes of the body, uncompressed
    header: dict


# Pages read per column chunk at most: a header takes about 45 us to read here, and a row group
# of 1M records of 256 float32 has about 1,000 pages (of 1 MiB) per column. A chunk of more (tiny
# pages) is read front to back instead, not planned for seconds while the reader waits.
MAX_PAGES = 20000


def walk_pages(f, start: int, length: int) -> list[Page]:
    """The pages of the column chunk at [start, start + length), by their headers;
    ThriftError past MAX_PAGES."""
    pages, pos, end = [], start, start + length
    while pos < end:
        if len(pages) >= MAX_PAGES:
            raise ThriftError(f"more than {MAX_PAGES} pages in a column chunk")
        # a header is tens of bytes, more with statistics; one over 16 MiB is taken for damage
        for n in (512, 64 << 10, 16 << 20):
            data = os.pread(f.fileno(), min(n, end - pos), pos)  # one call: one turn at the GIL
            try:
                header, used = decode_struct(data)
                break
            except ThriftError:
                if n >= end - pos or n == 16 << 20:
                    raise
        kind = header[1][1]
        body, raw = header[3][1], header[2][1]
        if kind == _DATA_PAGE:
            values = header[5][1][1][1]
        elif kind == _DATA_PAGE_V2:
            values = header[8][1][1][1]
        else:
            values = 0
        pages.append(Page(pos, used + body, kind, values, body, raw, header))
        pos += used + body
    if pos != end:
        raise ThriftError("pages run past their column chunk")
    return pages


def first_rep_level(f, page: Page, codec: str | None, width: int) -> int:
    """The repetition level of a data page's first value: 0 where a row starts there."""
    f.seek(page.offset + page.size - page.body)
    body = f.read(page.body)
    if page.kind == _DATA_PAGE_V2:
        levels = body  # levels first, never compressed
    else:
        if page.header[5][1][4][1] != _RLE:
            raise ThriftError("levels not RLE encoded")
        if codec is not None:
            import pyarrow as pa
            body = pa.decompress(body, decompressed_size=page.raw, codec=codec,
                                 asbytes=True)
        levels = body[4:]  # after the rep levels' byte length
    r = _Reader(levels)
    r.varint()  # the first run's header: RLE or bit-packed, its first value comes next either way
    return r.byte() & ((1 << width) - 1)


# ---- the plan --------------------------------------------------------------------------------

class PieceMismatch(Exception):
    """A piece's rows came out other than planned: read the row group as a whole instead."""


@dataclass
class ColumnPart:
    """One column's pages holding a piece's rows: rows [skip, skip + rows) of what they
    decode to are the piece's."""
    name: str  # the column's (top-level field's) name
    index: int  # of the column chunk in the row group
    pages: list[Page]
    dictionary: Page | None
    rows: int  # rows the pages hold
    skip: int


@dataclass
class Piece:
    group: int
    first: int  # its first row, within the row group
    rows: int
    columns: list[ColumnPart]


def _schema_subtrees(schema: list) -> dict[str, list]:
    """Top-level field name -> its SchemaElements (flattened, depth first)."""
    out, i = {}, 1
    while i < len(schema):
        j, pending = i, 1
        while pending:
            pending += schema[j].get(5, (0, 0))[1] - 1
            j += 1
        out[schema[i][4][1].decode()] = schema[i:j]
        i = j
    return out


def _walk_columns(f, footer: dict, group: int, per_row: dict[str, int]) -> dict | None:
    """Column name -> (index of its chunk, data pages, dictionary page, codec, values per row,
    repeated levels, [(row, page) where a row starts]) for the columns named in per_row; None
    where a column cannot be read page by page (see the module's docstring)."""
    rg = footer[4][1][1][group]
    num_rows = rg[3][1]
    chunks: dict[str, tuple[int, dict]] = {}
    for i, cc in enumerate(rg[1][1][1]):
        md = cc[3][1]
        name = md[3][1][1][0].decode()
        if name in per_row:
            if name in chunks or 1 in cc:  # a second leaf (a struct), or another file
                return None
            chunks[name] = (i, md)
    if set(chunks) != set(per_row):
        return None
    subtrees = _schema_subtrees(footer[2][1][1])
    walked = {}
    for name, (i, md) in chunks.items():
        codec = md[4][1]
        if codec not in _CODECS:
            return None
        start = md[11][1] if md.get(11, (0, 0))[1] > 0 else md[9][1]  # 0: none (old writers)
        pages = walk_pages(f, start, md[7][1])
        dictionary = pages[0] if pages and pages[0].kind == _DICTIONARY_PAGE else None
        data = pages[1:] if dictionary else pages
        if any(p.kind not in (_DATA_PAGE, _DATA_PAGE_V2) for p in data):
            return None
        k = per_row[name]
        if sum(p.values for p in data) != num_rows * k:  # a row of another size: as before
            return None
        repeated = sum(e.get(3, (0, 0))[1] == 2 for e in subtrees[name])
        levels, starts = 0, []
        for j, p in enumerate(data):
            if levels % k == 0:
                starts.append((levels // k, j))
            levels += p.values
        walked[name] = (i, data, dictionary, _CODECS[codec], k, repeated, starts)
    return walked


def whole_piece(f, footer: dict, group: int, per_row: dict[str, int]) -> Piece | None:
    """Row group `group` as one piece (for read_piece to decode); None where its columns cannot
    be read page by page."""
    walked = _walk_columns(f, footer, group, per_row)
    if walked is None:
        return None
    rows = footer[4][1][1][group][3][1]
    return Piece(group, 0, rows, [ColumnPart(name, i, data, dictionary, rows, 0)
                                  for name, (i, data, dictionary, *_) in walked.items()])


def plan_pieces(f, footer: dict, group: int, per_row: dict[str, int], piece_rows: int
                ) -> list[Piece] | None:
    """Cut row group `group` into pieces of about piece_rows rows, where every column named in
    per_row (column -> values per row, 1 for a scalar) has a page starting a row. None where it
    cannot be cut (see the module's docstring) or would make one piece."""
    num_rows = footer[4][1][1][group][3][1]
    if num_rows <= piece_rows:
        return None
    walked = _walk_columns(f, footer, group, per_row)
    if walked is None:
        return None
    starts = {name: w[6] for name, w in walked.items()}
    # cut where the column of the fewest row starts has one, about piece_rows apart
    sparse = min(starts, key=lambda n: len(starts[n]))
    cuts, last = [0], 0
    for row, _ in starts[sparse]:
        if row - last >= piece_rows and num_rows - row >= piece_rows // 4:
            cuts.append(row)
            last = row
    if len(cuts) < 2:
        return None
    bounds = cuts + [num_rows]
    pieces = []
    for lo, hi in zip(bounds, bounds[1:]):
        parts = []
        for name, (i, data, dictionary, codec, k, repeated, at) in walked.items():
            # the last page starting a row at or before lo, through the page ending hi's rows
            row0, p0 = max((r, j) for r, j in at if r <= lo)
            levels, p1 = row0 * k, p0
            while p1 < len(data) and (levels < hi * k or levels % k):
                levels += data[p1].values
                p1 += 1
            if p0 > 0 and repeated and first_rep_level(
                    f, data[p0], codec, repeated.bit_length()) != 0:
                return None  # a page starting mid-row, the sizes notwithstanding
            parts.append(ColumnPart(name, i, data[p0:p1], dictionary, levels // k - row0,
                                    lo - row0))
        pieces.append(Piece(group, lo, hi - lo, parts))
    return pieces


# ---- reading a piece -------------------------------------------------------------------------

class _Segments:
    """A read-only file made of byte ranges of another file and bytes of its own."""

    def __init__(self, path, parts: list[tuple[int, int] | bytes]):
        self._f = open(path, "rb")
        self._parts, at = [], 0
        for p in parts:
            n = len(p) if isinstance(p, bytes) else p[1]
            self._parts.append((at, n, p))
            at += n
        self.size, self.pos, self.closed = at, 0, False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        out = []
        for at, length, p in self._parts:
            lo, hi = max(self.pos, at), min(end, at + length)
            if lo >= hi:
                continue
            if isinstance(p, bytes):
                out.append(p[lo - at:hi - at])
            else:
                self._f.seek(p[0] + lo - at)  # a file of its own: one reader at a time
                out.append(self._f.read(hi - lo))
        self.pos = max(self.pos, end)
        return b"".join(out)

    def close(self) -> None:
        if not self.closed:
            self._f.close()
            self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _column_file(path, footer: dict, group: int, part: ColumnPart) -> _Segments:
    """A Parquet file of one column: the part's dictionary page, its data pages and a footer
    that makes them one row group."""
    rg = footer[4][1][1][group]
    cc = rg[1][1][1][part.index]
    md = {k: v for k, v in cc[3][1].items() if k in (1, 2, 3, 4)}
    ranges, at = [], 4
    if part.dictionary is not None:
        ranges.append((part.dictionary.offset, part.dictionary.size))
        md[11] = (_I64, at)
        at += part.dictionary.size
    md[9] = (_I64, at)
    first = part.pages[0].offset
    size = sum(p.size for p in part.pages)
    ranges.append((first, size))  # a piece's data pages are consecutive in the file
    pages = ([part.dictionary] if part.dictionary else []) + part.pages
    md[5] = (_I64, sum(p.values for p in part.pages))
    md[6] = (_I64, sum(p.size - p.body + p.raw for p in pages))
    md[7] = (_I64, sum(p.size for p in pages))
    column = {2: (_I64, 4), 3: (_STRUCT, md)}
    rows = part.rows
    schema = footer[2][1][1]
    root = dict(schema[0])
    root[5] = (_I32, 1)
    sub = _schema_subtrees(schema)[part.name]
    meta = {1: footer[1], 2: (_LIST, (_STRUCT, [root] + sub)), 3: (_I64, rows),
            4: (_LIST, (_STRUCT, [{1: (_LIST, (_STRUCT, [column])),
                                   2: (_I64, md[6][1]), 3: (_I64, rows)}]))}
    if 6 in footer:
        meta[6] = footer[6]  # created_by: pyarrow reads some writers' files their own way
    tail = encode_struct(meta)
    return _Segments(path, [b"PAR1", *ranges, tail + struct.pack("<I", len(tail)) + b"PAR1"])


# ---- a column read without its levels -----------------------------------------------------
# pyarrow spends most of a list column's decoding on its levels: a list<float> column of 256
# values a row decodes at 0.7M rows a second on the development machine, the same values as a
# required float column (no levels) at 2.8-3.6M. Where a column's levels say just what the
# spec's fixed shape does (every row that many values, no nulls), they are checked here and
# dropped: pyarrow decodes the values as a required column of scalars, and they are cut into
# rows again as lists. Levels are checked, not assumed: a section is read run by run in Python
# until a stretch of it repeats in whole rows (a writer encodes equal rows alike: pyarrow's rep
# levels for 256 values a row are the same 5 bytes, row after row), the repeats are compared
# as bytes, and what is left is read run by run again. A column whose levels do not check out,
# or that has more runs than that to read, is decoded with its levels by pyarrow as before.

_REQUIRED, _REPEATED = 0, 2  # SchemaElement.repetition_type (1 is OPTIONAL)
_MAX_RUNS = 1024  # runs of a page's level section read one by one, at most
_FLAT_BYTES = 8 << 20  # values decoded together: the pages of about this many bytes
_PLAIN = 0


def _rep_levels(dims: tuple[int, ...]) -> np.ndarray:
    """The repetition levels of one row of nested lists of shape dims (0 where it starts)."""
    idx = np.indices(dims).reshape(len(dims), -1).T
    out = np.zeros(len(idx), np.int64)
    out[1:] = np.argmax(idx[1:] != idx[:-1], axis=1) + 1  # the outermost list that moved on
    return out


def _run_values(data: bytes, pos: int, width: int) -> tuple[np.ndarray | int, int, int]:
    """One run of the RLE / bit-packed hybrid at pos: (its values, or its one value repeated,
    how many, the position after it)."""
    header = shift = 0
    while True:
        if pos >= len(data) or shift > 35:
            raise ThriftError("truncated levels")
        b = data[pos]
        pos += 1
        header |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    if header & 1:  # bit-packed: groups of 8 values of `width` bits, least significant first
        n = (header >> 1) * width
        if n == 0 or pos + n > len(data):
            raise ThriftError("truncated levels")
        bits = np.unpackbits(np.frombuffer(data, np.uint8, n, pos), bitorder="little")
        values = (bits.reshape(-1, width).astype(np.int64) << np.arange(width)).sum(axis=1)
        return values, len(values), pos + n
    nbytes = (width + 7) // 8
    if header >> 1 == 0 or pos + nbytes > len(data):
        raise ThriftError("truncated levels")
    return int.from_bytes(data[pos:pos + nbytes], "little"), header >> 1, pos + nbytes


class Levels:
    """The levels every row of a column holds: row[j] for its j-th value (repetition levels:
    0 where the row starts; definition levels: the maximum, no nulls). `known` holds the
    sections found to match (a writer repeats them: pages of as many rows encode alike)."""

    KNOWN = 32  # sections remembered, at most (a file's pages of as many rows, a few phases)
    KNOWN_BYTES = 64 << 10  # the longest remembered

    def __init__(self, row: np.ndarray):
        self.row, self.k = row, len(row)
        self.constant = int(row[0]) if (row == row[0]).all() else None
        self.tiled = np.tile(row, -(-(self.k + 1024) // self.k))  # row[(at + i) % k], i < 1024
        self.known: set[tuple[bytes, int, int, int]] = set()

    def expected(self, at: int, n: int) -> np.ndarray:
        at %= self.k
        if at + n <= len(self.tiled):
            return self.tiled[at:at + n]
        return self.row[(at + np.arange(n)) % self.k]


@functools.lru_cache(maxsize=16)
def levels_of(row: tuple[int, ...]) -> Levels:
    """The Levels of rows of these levels, shared by the threads reading a file's pieces."""
    return Levels(np.array(row, np.int64))


def levels_match(data: bytes, width: int, levels: Levels, phase: int, count: int) -> bool:
    """Whether a section of RLE / bit-packed levels holds exactly `count` levels, the first
    of them the row's phase-th, and nothing after them."""
    key = (data, width, phase % levels.k, count)
    if key in levels.known:
        return True
    if _levels_match(data, width, levels, phase, count):
        if len(data) <= levels.KNOWN_BYTES and len(levels.known) < levels.KNOWN:
            levels.known.add(key)
        return True
    return False


def _levels_match(data: bytes, width: int, levels: Levels, phase: int, count: int) -> bool:
    k, constant = levels.k, levels.constant
    pos = done = runs = 0
    seen: dict[int, tuple[int, int]] | None = {}  # done % k -> (pos, done) at a run's start
    while done < count:
        if seen is not None and done % k in seen:  # a stretch of whole rows: compare its repeats
            p0, d0 = seen[done % k]
            size, step = pos - p0, done - d0
            reps = min((count - done) // step, (len(data) - pos) // size)
            if reps:
                stretch = np.frombuffer(data, np.uint8, size, p0)
                block = np.frombuffer(data, np.uint8, reps * size, pos).reshape(reps, size)
                bad = np.flatnonzero((block != stretch).any(axis=1))
                same = int(bad[0]) if len(bad) else reps
                pos, done = pos + same * size, done + same * step
            seen = None
            continue
        if seen is not None and len(seen) < 16:
            seen[done % k] = (pos, done)
        runs += 1
        if runs > _MAX_RUNS:
            return False
        try:
            values, n, pos = _run_values(data, pos, width)
        except ThriftError:
            return False
        m = min(n, count - done)
        if isinstance(values, int):
            if n > count - done:
                return False
            ok = values == constant if constant is not None else (
                n <= k and (levels.expected(phase + done, n) == values).all())
        elif constant is not None:
            ok = (values[:m] == constant).all()
        else:
            ok = (values[:m] == levels.expected(phase + done, m)).all()
        if not ok:
            return False
        done += m
    return done == count and pos == len(data)


def _flat_leaf(subtree: list, dims: tuple[int, ...]) -> tuple[dict, int, int] | None:
    """(the leaf's SchemaElement, max repetition level, max definition level) of a column of
    len(dims) nested lists of a primitive; None for another layout."""
    leaf = subtree[-1]
    if leaf.get(5, (0, 0))[1] or 1 not in leaf:  # a group, not a primitive
        return None
    kinds = [e.get(3, (0, _REQUIRED))[1] for e in subtree]
    max_rep = kinds.count(_REPEATED)
    if max_rep != len(dims):
        return None
    return leaf, max_rep, len(kinds) - kinds.count(_REQUIRED)


def _page_header(kind: int, size: int, inner: int, header: dict) -> bytes:
    return encode_struct({1: (_I32, kind), 2: (_I32, size), 3: (_I32, size), inner:
                          (_STRUCT, header)})


class _NotFlat(Exception):
    """A page's levels are not those of rows of the fixed shape without nulls."""


class _Window:
    """Bytes of a file read _FLAT_BYTES at a time, up to `end`: the bodies of consecutive
    pages without a call (and a wait for the GIL after it) for each."""

    def __init__(self, fd: int, end: int):
        self.fd, self.end, self.lo, self.data = fd, end, 0, b""

    def get(self, offset: int, n: int) -> memoryview:
        if not self.lo <= offset <= offset + n <= self.lo + len(self.data):
            self.data = os.pread(self.fd, max(n, min(_FLAT_BYTES, self.end - offset)), offset)
            self.lo = offset
            if len(self.data) < n:
                raise ThriftError("truncated page")
        return memoryview(self.data)[offset - self.lo:offset - self.lo + n]


def _flat_pages(f, part: ColumnPart, codec: str | None, max_rep: int, max_def: int,
                rows: Levels) -> Iterator[tuple[object, int, object]]:
    """The part's pages without their levels, uncompressed: (body, values, encoding; for the
    dictionary page, first, its header), _NotFlat where a page's levels are not rows of rows.k
    values (rows: their repetition levels) without nulls."""
    import pyarrow as pa

    window = _Window(f.fileno(), part.pages[-1].offset + part.pages[-1].size)

    def read(page: Page):
        return window.get(page.offset + page.size - page.body, page.body)

    def inflate(body, size: int):
        if codec is None:
            return body
        return pa.decompress(body, decompressed_size=size, codec=codec, asbytes=False)

    if part.dictionary is not None:  # read alone: it is away from a piece's data pages
        d = part.dictionary
        body = os.pread(f.fileno(), d.body, d.offset + d.size - d.body)
        if len(body) != d.body:
            raise ThriftError("truncated page")
        yield inflate(body, d.raw), 0, d.header[7][1]
    full = levels_of((max_def,))
    rep_width, def_width = max_rep.bit_length(), max_def.bit_length()
    phase = 0
    for p in part.pages:
        body = read(p)
        if p.kind == _DATA_PAGE:
            h = p.header[5][1]
            body = memoryview(inflate(body, p.raw))
            sections, pos = [], 0
            for width, code in ((rep_width, 4), (def_width, 3)):
                if not width:
                    continue
                if h[code][1] != _RLE or pos + 4 > len(body):
                    raise _NotFlat
                n = int.from_bytes(body[pos:pos + 4], "little")
                sections.append(bytes(body[pos + 4:pos + 4 + n]))
                pos += 4 + n
            values, encoding = body[pos:], h[2][1]
        else:
            h = p.header[8][1]
            if h[2][1]:  # nulls
                raise _NotFlat
            def_len, rep_len = h[5][1], h[6][1]
            # copies: a view would keep the whole window alive in Levels.known
            sections = [bytes(body[:rep_len])] if rep_width else []
            if def_width:
                sections.append(bytes(body[rep_len:rep_len + def_len]))
            values, encoding = body[rep_len + def_len:], h[4][1]
            if codec is not None and h.get(7, (_TRUE, True))[1]:
                values = inflate(values, p.raw - rep_len - def_len)
        if rep_width and not levels_match(sections[0], rep_width, rows, phase, p.values):
            raise _NotFlat
        if def_width and not levels_match(sections[-1], def_width, full, 0, p.values):
            raise _NotFlat
        phase = (phase + p.values) % rows.k
        yield values, p.values, encoding


def _decode_flat(pages: list[tuple[object, int, object]], dictionary: bool, footer: dict,
                 name: str, md: dict, leaf: dict):
    """Decode pages (from _flat_pages, the dictionary page first where `dictionary`) as a
    Parquet file of one required column of the leaf's type: its values, a pyarrow array."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    count = sum(n for _, n, _ in pages)
    parts = []
    for i, (body, n, encoding) in enumerate(pages):
        if i == 0 and dictionary:
            parts.append(_page_header(_DICTIONARY_PAGE, len(body), 7, encoding))
        else:
            parts.append(_page_header(_DATA_PAGE, len(body), 5, {
                1: (_I32, n), 2: (_I32, encoding), 3: (_I32, _RLE), 4: (_I32, _RLE)}))
        parts.append(body)
    first = 4 + (len(parts[0]) + len(parts[1]) if dictionary else 0)
    size = sum(len(p) for p in parts)
    column = {1: md[1], 2: md[2], 3: (_LIST, (_BINARY, [name.encode()])), 4: (_I32, 0),
              5: (_I64, count), 6: (_I64, size), 7: (_I64, size), 9: (_I64, first)}
    if dictionary:
        column[11] = (_I64, 4)
    element = {fid: v for fid, v in leaf.items() if fid not in (3, 4)}
    element[3], element[4] = (_I32, _REQUIRED), (_BINARY, name.encode())
    meta = {1: footer[1], 2: (_LIST, (_STRUCT, [{4: (_BINARY, b"schema"), 5: (_I32, 1)},
                                                element])),
            3: (_I64, count),
            4: (_LIST, (_STRUCT, [{1: (_LIST, (_STRUCT, [{2: (_I64, 4), 3: (_STRUCT, column)}])),
                                   2: (_I64, size), 3: (_I64, count)}]))}
    if 6 in footer:
        meta[6] = footer[6]
    tail = encode_struct(meta)
    buffer = _allocate(4 + size + len(tail) + 8)
    blob = np.frombuffer(buffer, np.uint8)  # copies of pages release the GIL
    blob[:4] = np.frombuffer(b"PAR1", np.uint8)
    at = 4
    for part in parts:
        n = len(part)
        blob[at:at + n] = np.frombuffer(part, np.uint8)
        at += n
    blob[at:] = np.frombuffer(tail + struct.pack("<I", len(tail)) + b"PAR1", np.uint8)
    table = pq.ParquetFile(pa.BufferReader(buffer), pre_buffer=False).read(
        use_threads=False)
    return table.column(0).combine_chunks() if table.column(0).num_chunks != 1 else \
        table.column(0).chunk(0)


def _allocate(nbytes: int):
    """A writable pyarrow buffer from pyarrow's memory pool, which keeps freed memory for the
    next: a fresh 64 MiB numpy array each piece would be mapped, faulted in page by page and
    unmapped (which stops every thread of the process to flush their page tables) each time."""
    import pyarrow as pa

    return pa.allocate_buffer(nbytes)


# physical types whose PLAIN values are the values pyarrow gives, where no logical type is set
_PLAIN_DTYPES = {1: np.dtype("<i4"), 2: np.dtype("<i8"), 4: np.dtype("<f4"), 5: np.dtype("<f8")}


def _read_flat(path, footer: dict, group: int, part: ColumnPart, dims: tuple[int, ...]):
    """The part's rows (a pyarrow array of lists of shape dims, or of scalars) decoded without
    their levels; None where the column or its levels are not those of such rows.

    Values PLAIN-encoded as pyarrow would give them are copied straight from their pages; other
    pages (dictionary indices, strings, ...) are decoded by pyarrow, _FLAT_BYTES at a time."""
    import pyarrow as pa

    found = _flat_leaf(_schema_subtrees(footer[2][1][1])[part.name], dims)
    if found is None:
        return None
    leaf, max_rep, max_def = found
    md = footer[4][1][1][group][1][1][1][part.index][3][1]
    rows = levels_of(tuple(_rep_levels(dims).tolist()) if dims else (0,))
    decode = functools.partial(_decode_flat, dictionary=part.dictionary is not None,
                               footer=footer, name=part.name, md=md, leaf=leaf)
    dtype = None if 6 in leaf or 10 in leaf else _PLAIN_DTYPES.get(leaf[1][1])
    total = part.rows * rows.k
    buffer = _allocate(total * dtype.itemsize) if dtype is not None else None
    out = np.frombuffer(buffer, dtype) if dtype is not None else None
    chunks, batch, size, at = [], [], 0, 0  # at: values placed in out, or in chunks

    def flush():
        nonlocal batch, size, at
        values = decode(dictionary + batch)
        if out is None:
            chunks.append(values)
        elif len(values) > total - at:
            raise PieceMismatch(f"{part.name}: more values than planned")
        else:
            out[at:at + len(values)] = values.to_numpy()
        at += len(values)
        batch, size = [], 0

    with open(path, "rb") as f:
        pages = _flat_pages(f, part, _CODECS[md[4][1]], max_rep, max_def, rows)
        try:
            dictionary = [next(pages)] if part.dictionary is not None else []
            for page in pages:
                if out is not None and page[2] == _PLAIN:
                    if batch:
                        flush()
                    n = page[1]
                    values = np.frombuffer(page[0], np.uint8)
                    if n > total - at or len(values) != n * dtype.itemsize:
                        raise PieceMismatch(f"{part.name}: a page's values are not as planned")
                    out.view(np.uint8)[at * dtype.itemsize:(at + n) * dtype.itemsize] = values
                    at += n
                    continue
                batch.append(page)
                size += len(page[0])
                if size >= _FLAT_BYTES:
                    flush()
            if batch:
                flush()
        except _NotFlat:
            return None
    if at != total:
        raise PieceMismatch(f"{part.name}: {at} values where {part.rows} rows of {rows.k} "
                            f"were planned")
    if out is not None:
        values = pa.Array.from_buffers(pa.from_numpy_dtype(dtype), total, [None, buffer])
    elif not chunks:  # no pages: nothing to read (a piece has rows)
        return None
    else:
        values = chunks[0] if len(chunks) == 1 else pa.concat_arrays(chunks)
    for d in reversed(dims):  # the rows' lists, innermost first
        n = len(values) // d
        offsets = np.arange(n + 1, dtype=np.int64) * d
        large = offsets[-1] >= 1 << 31
        values = (pa.LargeListArray if large else pa.ListArray).from_arrays(
            pa.array(offsets if large else offsets.astype(np.int32)), values)
    return values


class Flat:
    """The columns to read without their levels (read_piece), by their shape per row (() for a
    scalar). A column is given up on, read with its levels from then on, after GIVE_UP pieces
    whose levels were not those of such rows (nulls, other lengths): each such try costs a
    piece's reading. Shared by the threads reading a file."""

    GIVE_UP = 2

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes, self.misses = dict(shapes), {}

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.shapes.get(name) if self.misses.get(name, 0) < self.GIVE_UP else None

    def missed(self, name: str) -> None:
        self.misses[name] = self.misses.get(name, 0) + 1

    def trying(self) -> bool:
        return any(self.shape(name) is not None for name in self.shapes)


def read_piece(path, footer: dict, piece: Piece, flat: Flat | None = None):
    """The piece's rows as a pyarrow RecordBatch of its columns; PieceMismatch where they do
    not come out as planned. The columns `flat` names are read without their levels where
    those check out (see _read_flat)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = []
    for part in piece.columns:
        col = None
        shape = flat.shape(part.name) if flat is not None else None
        if shape is not None:
            col = _read_flat(path, footer, piece.group, part, shape)
            if col is None:
                flat.missed(part.name)
        if col is None:
            with _column_file(path, footer, piece.group, part) as vf:
                # pages read 1 MiB at a time, as formats.PARQUET_BUFFER_BYTES (which imports
                # this)
                table = pq.ParquetFile(vf, pre_buffer=False, buffer_size=1 << 20).read()
            col = table.column(0)
            if len(col) != part.rows:
                raise PieceMismatch(f"{part.name}: {len(col)} rows where {part.rows} were "
                                    f"planned")
            # one chunk as pyarrow reads a row group: a view of it (combine_chunks would copy)
            col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
        arrays.append(col.slice(part.skip, piece.rows))
    return pa.RecordBatch.from_arrays(arrays, names=[part.name for part in piece.columns])
