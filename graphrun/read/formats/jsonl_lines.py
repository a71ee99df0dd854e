"""JSONL lines as graphrun reads them, whatever wrote the file: a UTF-8 byte order mark, lines
ended by CR alone, a field repeated within a record, an id JSON allows but UTF-8 cannot hold
(a lone surrogate escape). jsonl.py and jsonl_parse.py call these; each is self-contained.
"""

from __future__ import annotations

import difflib

import json
import operator
from itertools import repeat

BOM = b"\xef\xbb\xbf"


def lines_of(f):
    """f, or a reader of it that turns lone CRs into LFs when the file's first 64 KiB hold a
    CR and no LF; a BOM at the start is skipped either way."""
    head = f.peek(1 << 16)[:1 << 16] if hasattr(f, "peek") else b""
    if head.startswith(BOM):
        f.read(len(BOM))
        head = head[len(BOM):]
    if b"\r" in head and b"\n" not in head:
        return _CrLines(f)
    return f


class _CrLines:
    """readlines(hint) of a file whose lines end in CR: whole lines, LF-terminated."""

    def __init__(self, f):
        self.f, self.rest = f, b""

    def readlines(self, hint: int) -> list[bytes]:
        while True:
            data = self.f.read(max(hint, 1 << 16))
            text = self.rest + data.replace(b"\r", b"\n")
            cut = text.rfind(b"\n") + 1 if data else len(text)
            if cut or not data:
                self.rest = text[cut:]
                return text[:cut].splitlines(keepends=True)
            self.rest = text


def encodable(text: str) -> bool:
    """str from JSON may hold lone surrogates ("\\ud800"), which UTF-8 cannot encode."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def repeated_keys(lines: list[bytes], expected: set, reasons: list[str]) -> list[str]:
    """reasons, with one for each line whose object repeats a field (JSON parsers keep the
    last value silently). One count per field over the block finds the candidates: more
    quoted names than lines holding the name means a repeat (or the name inside a value), and
    only those lines are parsed again, keeping every pair."""
    block = b"".join(lines)
    for key in expected:
        quoted = json.dumps(key).encode()
        if block.count(quoted) <= sum(map(operator.contains, lines, repeat(quoted))):
            continue
        for p, line in enumerate(lines):
            if not reasons[p] and line.count(quoted) > 1:
                reasons[p] = _repeat_in(line)
    return reasons


def _repeat_in(line: bytes) -> str:
    found = []

    def pairs(items):
        names = [k for k, _ in items]
        found.extend(k for k in names if names.count(k) > 1)
        return dict(items)

    try:
        json.loads(line.decode("utf-8"), object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return ""  # not this check's to report
    return (f"field {found[0]!r} appears more than once in the record; JSON would keep only "
            "the last: remove the others") if found else ""


def readable_id(record, id_field: str | None):
    """The id of a parsed record rejected for another reason (a repeated field), if usable."""
    rid = record.get(id_field) if id_field and type(record) is dict else None
    return rid if type(rid) is int or (type(rid) is str and encodable(rid)) else None


def close_field(wanted: str, held: list[str]) -> str:
    """"; the record has 'ids' ..." where one of the record's other fields looks like the one
    missing (a prefix dropped, a typo): the usual cause of a missing field."""
    near = [k for k in held if isinstance(k, str) and k and (k in wanted or wanted in k)]
    near = near or difflib.get_close_matches(wanted, [k for k in held if isinstance(k, str)],
                                             n=1, cutoff=0.6)
    if not near:
        return ""
    return (f"; the record has {near[0]!r}, which may be it: rename the field in the data, or "
            f"the input in the spec")
