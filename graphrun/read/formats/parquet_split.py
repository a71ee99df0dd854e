"""One Parquet row group cut into pieces of rows, each decoded by pyarrow on a thread of its own.

pyarrow decodes a column chunk on one thread from its first page to its last and cannot read a
row range inside a row group (apache/arrow#38865), so a file written as one big row group (as
pandas and pq.write_table write up to 1Mi rows) would decode at one thread's rate. This module
cuts the row group at page boundaries: plan_pieces reads each column chunk's page headers (the
only thing decoded here), picks pages where a row starts about every `piece_rows` rows, and
each Piece hands pyarrow a file of one column made of the chunk's dictionary page, the piece's
data pages and a footer written here from pyarrow's metadata objects.

A row group that cannot be cut (an unknown codec or page kind, rows of varying size, levels
other than those of plain nested lists) gets None and is read whole as before; a piece whose
rows do not come out as planned raises PieceMismatch. Both only cost speed.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

MAX_PAGES = 20000  # page headers read per column chunk at most: more (tiny pages) is not cut
_DATA, _DICTIONARY, _DATA_V2 = 0, 2, 3  # PageHeader.type
_TYPES = {"BOOLEAN": 0, "INT32": 1, "INT64": 2, "FLOAT": 4, "DOUBLE": 5, "BYTE_ARRAY": 6,
          "FIXED_LEN_BYTE_ARRAY": 7}
_CODECS = {"UNCOMPRESSED": 0, "SNAPPY": 1, "GZIP": 2, "BROTLI": 4, "ZSTD": 6, "LZ4_RAW": 7}
_ENCODINGS = {"PLAIN": 0, "PLAIN_DICTIONARY": 2, "RLE": 3, "BIT_PACKED": 4,
              "DELTA_BINARY_PACKED": 5, "DELTA_LENGTH_BYTE_ARRAY": 6, "DELTA_BYTE_ARRAY": 7,
              "RLE_DICTIONARY": 8, "BYTE_STREAM_SPLIT": 9}
# ConvertedType of the leaves whose values need one to read as they were written
_CONVERTED = {pa.int8(): 15, pa.int16(): 16, pa.uint8(): 11, pa.uint16(): 12,
              pa.uint32(): 13, pa.uint64(): 14, pa.string(): 0, pa.large_string(): 0}
_I32, _I64, _BINARY, _LIST, _STRUCT = 5, 6, 8, 9, 12  # Thrift compact types


class PieceMismatch(Exception):
    """A piece's rows came out other than planned: read the row group whole instead."""


# ---- Thrift compact protocol, as far as page headers and a footer need it -------------------

def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = data[pos]  # IndexError where the header is cut short
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _read_struct(data: bytes, pos: int) -> tuple[dict, int]:
    """{field id: value} of the struct at pos (nested structs as dicts), and where it ends."""
    fields, fid = {}, 0
    while True:
        head = data[pos]
        pos += 1
        kind = head & 0x0F
        if kind == 0:
            return fields, pos
        if head >> 4:
            fid += head >> 4
        else:
            raw, pos = _read_varint(data, pos)
            fid = (raw >> 1) ^ -(raw & 1)
        fields[fid], pos = _read_value(data, pos, kind)


def _read_value(data: bytes, pos: int, kind: int):
    if kind in (1, 2):  # a bool field holds its value in its type
        return kind == 1, pos
    if kind == 3:
        return data[pos], pos + 1
    if kind in (4, _I32, _I64):
        raw, pos = _read_varint(data, pos)
        return (raw >> 1) ^ -(raw & 1), pos
    if kind == 7:
        return data[pos:pos + 8], pos + 8
    if kind == _BINARY:
        n, pos = _read_varint(data, pos)
        return data[pos:pos + n], pos + n
    if kind in (_LIST, 10):
        head = data[pos]
        pos += 1
        n, inner = head >> 4, head & 0x0F
        if n == 15:
            n, pos = _read_varint(data, pos)
        items = []
        for _ in range(n):
            item, pos = _read_value(data, pos, inner)
            items.append(item)
        return items, pos
    if kind == _STRUCT:
        return _read_struct(data, pos)
    raise ValueError(f"Thrift type {kind} in a page header")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out) + bytes([n])


def _write_struct(fields: list[tuple[int, int, object]]) -> bytes:
    """fields: (id, Thrift type, value) in increasing id; values: int, bytes, a list of
    (type, items), or a nested list of fields."""
    out, last = bytearray(), 0
    for fid, kind, value in fields:
        out += bytes([(fid - last) << 4 | kind]) if 0 < fid - last <= 15 else (
            bytes([kind]) + _varint(fid << 1))
        last = fid
        out += _write_value(kind, value)
    return bytes(out + b"\x00")


def _write_value(kind: int, value) -> bytes:
    if kind in (_I32, _I64):
        return _varint((value << 1) ^ (value >> 63))
    if kind == _BINARY:
        return _varint(len(value)) + value
    if kind == _LIST:
        inner, items = value
        head = bytes([len(items) << 4 | inner]) if len(items) < 15 else (
            bytes([0xF0 | inner]) + _varint(len(items)))
        return head + b"".join(_write_value(inner, item) for item in items)
    return _write_struct(value)


# ---- the plan --------------------------------------------------------------------------------

@dataclass
class _Page:
    kind: int  # _DATA, _DICTIONARY, _DATA_V2
    offset: int  # of its header in the file
    header: dict
    size: int  # header and body as stored
    raw: int  # header and body uncompressed
    values: int  # levels it holds (0 for a dictionary page)


@dataclass
class _Column:
    """One column chunk of the row group: what a piece's file of it needs."""
    name: str
    meta: object  # pyarrow's ColumnChunkMetaData
    schema: list  # the column file's SchemaElements, each a list of (id, type, value)
    path: list[bytes]  # the leaf's path in that schema
    per_row: int  # values a row holds
    max_rep: int  # its maximum repetition level
    dictionary: _Page | None
    pages: list[_Page]
    starts: list[tuple[int, int]]  # (row, page) where a data page starts a row


@dataclass
class Piece:
    """Rows [first, first + rows) of row group `group`; read() decodes them."""
    path: str
    group: int
    first: int
    rows: int
    created_by: str
    parts: list[tuple[_Column, int, int, int]]  # (column, first page, end page, its first row)

    def read(self) -> pa.RecordBatch:
        """The piece's rows; PieceMismatch where they do not come out as planned."""
        arrays = []
        for column, p0, p1, row0 in self.parts:
            data = pa.BufferReader(_column_file(self, column, p0, p1))
            # this pool thread decodes it: no pyarrow threads of its own
            col = pq.ParquetFile(data).read_row_group(0, use_threads=False).column(0)
            held = sum(p.values for p in column.pages[p0:p1]) // column.per_row
            if len(col) != held:
                raise PieceMismatch(f"{column.name}: {len(col)} rows where {held} were planned")
            # one chunk as pyarrow reads a row group: a view of it (combine_chunks would copy)
            col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
            arrays.append(col.slice(self.first - row0, self.rows))
        return pa.RecordBatch.from_arrays(arrays, names=[c.name for c, *_ in self.parts])


def plan_pieces(path, meta: pq.FileMetaData, group: int, per_row: dict[str, int],
                piece_rows: int) -> list[Piece] | None:
    """Row group `group` of the file at `path` cut into pieces of about piece_rows rows, where
    every column named in per_row (name -> values per row, 1 for a scalar) has a page starting
    a row; None where it cannot be cut or would make one piece."""
    rg, arrow = meta.row_group(group), meta.schema.to_arrow_schema()
    if rg.num_rows <= piece_rows:
        return None
    columns = []
    with open(path, "rb") as f:
        for i in range(rg.num_columns):
            name = rg.column(i).path_in_schema.split(".")[0]
            if name in per_row:
                columns.append(_walk(f, rg.column(i), meta.schema.column(i), arrow.field(name),
                                     per_row[name], rg.num_rows))
    if None in columns or sorted(c.name for c in columns) != sorted(per_row):
        return None  # a column that cannot be cut, or of several leaves (a struct)
    sparse = min(columns, key=lambda c: len(c.starts))  # cut where it starts a row
    cuts = [0]
    for row, _ in sparse.starts:
        if row - cuts[-1] >= piece_rows and rg.num_rows - row >= piece_rows // 4:
            cuts.append(row)
    if len(cuts) < 2:
        return None
    bounds, pieces = cuts + [rg.num_rows], []
    with open(path, "rb") as f:
        for lo, hi in zip(bounds, bounds[1:]):
            parts = []
            for c in columns:
                row0, p0 = max((r, j) for r, j in c.starts if r <= lo)
                p1 = min([j for r, j in c.starts if r >= hi] + [len(c.pages)])
                if p0 and c.max_rep and not _starts_row(f, c.pages[p0], c.meta, c.max_rep):
                    return None  # a page starting mid-row, the counts notwithstanding
                parts.append((c, p0, p1, row0))
            pieces.append(Piece(str(path), group, lo, hi - lo, meta.created_by or "", parts))
    return pieces


def _walk(f, chunk, leaf, field: pa.Field, per_row: int, num_rows: int) -> _Column | None:
    """The column chunk's pages, by their headers; None where it cannot be cut."""
    shape = _schema(field, chunk.physical_type)
    if (shape is None or chunk.compression not in _CODECS or chunk.file_path
            or any(e not in _ENCODINGS for e in chunk.encodings)
            or (leaf.max_repetition_level, leaf.max_definition_level) != shape[2:]):
        return None
    schema, path, max_rep, _ = shape
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    pages, pos, end = [], start, start + chunk.total_compressed_size
    while pos < end and len(pages) < MAX_PAGES:
        try:
            header, used = _read_struct(os.pread(f.fileno(), min(64 << 10, end - pos), pos), 0)
            kind, raw, body = header[1], header[2], header[3]
            values = header[{_DATA: 5, _DATA_V2: 8}[kind]][1] if kind != _DICTIONARY else 0
        except (IndexError, KeyError, ValueError, TypeError):
            return None  # a header past 64 KiB, an index page, damage: not cut
        if kind == _DICTIONARY and pages:
            return None
        pages.append(_Page(kind, pos, header, used + body, used + raw, values))
        pos += used + body
    dictionary = pages.pop(0) if pages and pages[0].kind == _DICTIONARY else None
    if pos != end or sum(p.values for p in pages) != num_rows * per_row:
        return None  # rows of another size, or too many pages
    starts, seen = [], 0  # by the counts: checked at the pages cut at (_starts_row)
    for j, p in enumerate(pages):
        if seen % per_row == 0:
            starts.append((seen // per_row, j))
        seen += p.values
    return _Column(field.name, chunk, schema, path, per_row, max_rep, dictionary, pages, starts)


def _starts_row(f, page: _Page, chunk, max_rep: int) -> bool:
    """Whether the data page's first value starts a row (its repetition level is 0)."""
    body = os.pread(f.fileno(), page.size, page.offset)[page.size - page.header[3]:]
    if page.kind == _DATA:
        if page.header[5].get(4) != _ENCODINGS["RLE"]:
            return False
        if chunk.compression != "UNCOMPRESSED":
            body = pa.decompress(body, decompressed_size=page.header[2], asbytes=True,
                                 codec=chunk.compression.lower())
        body = body[4:]  # after the levels' byte length
    _, pos = _read_varint(body, 0)  # an RLE or bit-packed run: its first value comes next
    return body[pos] & ((1 << max_rep.bit_length()) - 1) == 0


def _schema(field: pa.Field, physical: str) -> tuple | None:
    """(SchemaElements, leaf path, max repetition, max definition level) of a file holding
    `field` alone, as pyarrow writes it; None for a type not cut here."""
    elements = [[(4, _BINARY, b"schema"), (5, _I32, 1)]]
    path, rep, defined, name = [], 0, 0, field.name.encode()
    t, nullable = field.type, field.nullable
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        elements += [[(3, _I32, int(nullable)), (4, _BINARY, name), (5, _I32, 1), (6, _I32, 3)],
                     [(3, _I32, 2), (4, _BINARY, b"list"), (5, _I32, 1)]]
        path += [name, b"list"]
        rep, defined = rep + 1, defined + int(nullable) + 1
        name, t, nullable = b"element", t.value_type, t.value_field.nullable
    half = t == pa.float16()  # FIXED_LEN_BYTE_ARRAY(2) of LogicalType FLOAT16 (field 15)
    if physical not in _TYPES or (physical == "FIXED_LEN_BYTE_ARRAY") != half:
        return None
    leaf = [(1, _I32, _TYPES[physical])] + ([(2, _I32, 2)] if half else []) + [
        (3, _I32, int(nullable)), (4, _BINARY, name)]
    if t in _CONVERTED:
        leaf.append((6, _I32, _CONVERTED[t]))
    if half:
        leaf.append((10, _STRUCT, [(15, _STRUCT, [])]))
    return elements + [leaf], path + [name], rep, defined + int(nullable)


def _column_file(piece: Piece, column: _Column, p0: int, p1: int) -> bytes:
    """A Parquet file of one column, in memory (pyarrow then decodes it without calling back
    into Python): its dictionary page, data pages [p0, p1) and a footer that makes them one
    row group."""
    pages = column.pages[p0:p1]
    head = [column.dictionary] if column.dictionary else []
    at, ranges, meta = 4, [], column.meta
    for p in head:
        ranges.append((p.offset, p.size))
        at += p.size
    ranges.append((pages[0].offset, sum(p.size for p in pages)))  # consecutive in the file
    md = [(1, _I32, _TYPES[meta.physical_type]),
          (2, _LIST, (_I32, [_ENCODINGS[e] for e in meta.encodings])),
          (3, _LIST, (_BINARY, column.path)), (4, _I32, _CODECS[meta.compression]),
          (5, _I64, sum(p.values for p in pages)),
          (6, _I64, sum(p.raw for p in head + pages)),
          (7, _I64, sum(p.size for p in head + pages)), (9, _I64, at)]
    if head:
        md.append((11, _I64, 4))
    rows = sum(p.values for p in pages) // column.per_row
    group = [(1, _LIST, (_STRUCT, [[(2, _I64, 4), (3, _STRUCT, md)]])), (2, _I64, md[5][2]),
             (3, _I64, rows)]
    footer = _write_struct([(1, _I32, 1), (2, _LIST, (_STRUCT, column.schema)), (3, _I64, rows),
                            (4, _LIST, (_STRUCT, [group])),
                            (6, _BINARY, piece.created_by.encode())])
    with open(piece.path, "rb") as f:
        data = [os.pread(f.fileno(), n, offset) for offset, n in ranges]
    if sum(map(len, data)) != sum(n for _, n in ranges):
        raise PieceMismatch("the file is shorter than its metadata says")
    return b"".join([b"PAR1", *data, footer, struct.pack("<I", len(footer)), b"PAR1"])
