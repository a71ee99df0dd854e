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

import os
import struct
from dataclasses import dataclass


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
            f.seek(pos)
            data = f.read(min(n, end - pos))
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


def plan_pieces(f, footer: dict, group: int, per_row: dict[str, int], piece_rows: int
                ) -> list[Piece] | None:
    """Cut row group `group` into pieces of about piece_rows rows, where every column named in
    per_row (column -> values per row, 1 for a scalar) has a page starting a row. None where it
    cannot be cut (see the module's docstring) or would make one piece."""
    rg = footer[4][1][1][group]
    num_rows = rg[3][1]
    if num_rows <= piece_rows:
        return None
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
    starts: dict[str, list[tuple[int, int]]] = {}  # column -> (row, page) where rows start
    walked: dict[str, tuple[list[Page], Page | None, str | None, int, int]] = {}
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
        walked[name] = (data, dictionary, _CODECS[codec], k, repeated)
        levels, at = 0, []
        for j, p in enumerate(data):
            if levels % k == 0:
                at.append((levels // k, j))
            levels += p.values
        starts[name] = at
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
        for name, (i, _) in chunks.items():
            data, dictionary, codec, k, repeated = walked[name]
            at = starts[name]
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


def read_piece(path, footer: dict, piece: Piece):
    """The piece's rows as a pyarrow RecordBatch of its columns; PieceMismatch where they do
    not come out as planned."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = []
    for part in piece.columns:
        with _column_file(path, footer, piece.group, part) as vf:
            # pages read 1 MiB at a time, as formats.PARQUET_BUFFER_BYTES (which imports this)
            table = pq.ParquetFile(vf, pre_buffer=False, buffer_size=1 << 20).read()
        col = table.column(0)
        if len(col) != part.rows:
            raise PieceMismatch(f"{part.name}: {len(col)} rows where {part.rows} were "
                                f"planned")
        col = col.slice(part.skip, piece.rows)
        # one chunk as pyarrow reads a row group: a view of it (combine_chunks would copy)
        arrays.append(col.chunk(0) if col.num_chunks == 1 else col.combine_chunks())
    return pa.RecordBatch.from_arrays(arrays, names=[part.name for part in piece.columns])
