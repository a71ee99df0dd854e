"""A JSONL block's lines parsed and converted into Candidates, here or in a child process
(jsonl_workers.py).

A block's lines are parsed by one call (see _parse_together; orjson where installed, several
times faster than json for float-heavy records) and each input's values converted by one
np.asarray; a block with a bad line, or with records of different shapes, falls back to one
json.loads per line or one conversion per record.
"""

from __future__ import annotations

import json
import random
import sys

import numpy as np

from graphrun.read.formats.jsonl_lines import (close_field, encodable, readable_id,
                                               repeated_keys)
from graphrun.read.prompts import Prompts
from graphrun.read.records import Candidates, Reject, field_from_values
from graphrun.read.requests import shown
from graphrun.spec.keys import PipelineSpec

# orjson reads an integer literal past 64 bits as a float this large or larger
_INT_RANGE = 2.0 ** 63

try:  # optional: a faster JSON parser for the block parse (see _loads_block)
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None


def parse_block(spec: PipelineSpec, block: tuple) -> Candidates:
    """block: (file, lines, their line numbers, the first's ordinal), as JsonlReader cuts them."""
    return jsonl_candidates(spec, *block)


def jsonl_candidates(spec: PipelineSpec, file: str, lines: list[bytes], linenos: list[int],
                      first: int) -> Candidates:
    """lines [n]: consecutive records, the first with ordinal `first`."""
    id_field = spec.data.id_field
    expected = set(spec.inputs) | ({id_field} if id_field else set())
    records = _parse_together(lines)
    reasons = [""] * len(lines)
    if records is None:  # some line is bad: parse line by line for its reason
        records, reasons = zip(*map(parse_line, lines))
    text = spec.data.text
    # the fields read: a repeated one is a bad line (json keeps the last value silently)
    keyed = expected if text is None else set(Prompts(spec).fields) | (
        {id_field} if id_field else set())
    reasons = repeated_keys(lines, keyed, list(reasons))
    if spec.data.text is not None:  # a text field tokenized into the inputs (read/text.py)
        from graphrun.read.text import jsonl_text_candidates
        return jsonl_text_candidates(spec, file, records, reasons, linenos, first)
    good, rejects = [], []
    for p, record in enumerate(records):
        if (not reasons[p] and type(record) is dict and record.keys() == expected
                and (id_field is None or type(record[id_field]) is int
                     or (type(record[id_field]) is str and encodable(record[id_field])))):
            good.append(p)
            continue
        rid, reason = ((readable_id(record, id_field), reasons[p]) if reasons[p]
                       else _record_problem(spec, record))
        rejects.append(Reject(first + p, rid if id_field else first + p,
                              f"{file}:{linenos[p]}", reason))
    records = [records[p] for p in good]
    # numpy reads a bool among numbers as 0/1 without a trace: note the lines that may hold one
    suspects = [k for k, p in enumerate(good) if b"true" in lines[p] or b"false" in lines[p]]
    fields, problems = {}, {}
    for name, inp in spec.inputs.items():
        fields[name], found = field_from_values(name, inp, [r[name] for r in records], suspects)
        for k, reason in found.items():
            problems.setdefault(k, reason)
    return Candidates(
        indices=np.array(good, np.int64) + first,
        ids=[r[id_field] for r in records] if id_field else None,
        where=[f"{file}:{linenos[p]}" for p in good],
        fields=fields, problems=problems, rejects=rejects)


def line_ids(lines: list[bytes], id_field: str, first: int) -> tuple[list[int], list]:
    """(ordinals, ids) of the lines (consecutive records, the first with ordinal `first`)
    whose id field parses as an int or a str: the lines parsed, no field converted."""
    records = _parse_together(lines)
    if records is None:  # some line is bad: it has no id
        records = [parse_line(line)[0] for line in lines]
    ordinals, ids = [], []
    for p, record in enumerate(records):
        rid = record.get(id_field) if type(record) is dict else None
        if type(rid) is int or type(rid) is str:
            ordinals.append(first + p)
            ids.append(rid)
    return ordinals, ids


def _record_problem(spec: PipelineSpec, record) -> tuple[object, str]:
    """(id if readable, reason) for a parsed line that is not a good record."""
    id_field = spec.data.id_field
    expected = sorted(set(spec.inputs) | ({id_field} if id_field else set()))
    fields = ", ".join(expected)
    if not isinstance(record, dict):
        return None, f"the record is {_json_kind(record)}; expected an object with fields {fields}"
    rid = None
    if id_field:
        rid = record.get(id_field)
        if rid is None:
            return None, f"missing id: field {id_field!r} is absent or null"
        if type(rid) not in (str, int):
            return None, (f"id field {id_field!r} must be a string or an integer, got "
                          f"{_json_kind(rid)} ({shown(rid)})")
        if type(rid) is str and not encodable(rid):
            return rid, (f"id field {id_field!r} is not valid Unicode (it holds a lone "
                         "surrogate escape such as \\ud800), so no output format can store it")
    missing = [k for k in spec.inputs if k not in record]
    unknown = [k for k in record if k not in expected]
    if missing:
        return rid, (f"missing field {missing[0]!r} (expected fields: {fields})"
                     + close_field(missing[0], unknown))
    return rid, f"unknown field {unknown[0]!r} (expected fields: {fields})"


def _parse_together(lines: list[bytes]) -> list | None:
    """All lines parsed by one json.loads (several times faster than one call per line), or
    None if any line is bad. Each line is wrapped as [marker, line] with a random marker per
    line, so that a line that is not exactly one JSON value cannot pass: a line holding two
    values or ending mid-value adds, shifts or swallows markers."""
    base = random.getrandbits(48)
    text = b"[" + b",".join([b"[%d,%b]" % (base + k, line) for k, line in enumerate(lines)]) + b"]"
    try:
        parsed = _loads_block(text)
    except (ValueError, RecursionError):  # also UnicodeDecodeError, orjson's JSONDecodeError
        return None
    if len(parsed) != len(lines) or sum(map(len, parsed)) != 2 * len(parsed):
        return None
    if [e[0] for e in parsed] != list(range(base, base + len(lines))):
        return None
    return [e[1] for e in parsed]


def _loads_block(text: bytes):
    """orjson where it is installed (it parses numbers several times faster), else json. A
    block orjson refuses (NaN or Infinity literals) falls back to one json.loads per line,
    which reads those and gives each bad line its own reason. orjson reads an integer past 64
    bits as a float, json as the int it is: a block whose records hold such a float in a
    field (an id, a seed; not inside a list) is parsed again by json."""
    if _orjson is not None:
        parsed = _orjson.loads(text)
        if not _past_int_range([e[1] for e in parsed if type(e) is list and len(e) == 2]):
            return parsed
    return json.loads(text.decode("utf-8"))


def _past_int_range(values) -> bool:
    """A float at least 2**63 in size among `values`, or among the values of an object in
    them (at any depth; lists are not looked into): where orjson may have read an integer."""
    for v in values:
        kind = type(v)
        if kind is dict:
            if _past_int_range(v.values()):
                return True
        elif kind is float and not -_INT_RANGE < v < _INT_RANGE:
            return True
    return False


def _unclosed_string(text: str) -> int | None:
    """The column of the opening quote of a string the line never closes, or None."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return e.pos + 1 if e.msg.startswith("Unterminated string") else None
    return None


def parse_line(line: bytes) -> tuple[object, str]:
    """(value, "") or (None, reason)."""
    truncated = "truncated last line (the file ends mid-record)"
    last = not line.endswith(b"\n")  # only the file's last line can lack one
    try:
        return json.loads(line.decode("utf-8")), ""
    except RecursionError:
        return None, "nested too deeply to parse (thousands of brackets): not a record"
    except UnicodeDecodeError as e:
        return None, truncated if last else (
            f"invalid UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line)")
    except json.JSONDecodeError as e:
        if last:
            return None, truncated
        # the line's own column: a line cut short fails past its newline, at "column 1" of
        # a second line, so the position is taken within the line without it
        text = line.rstrip(b"\r\n").decode("utf-8")
        opened = _unclosed_string(text) if e.pos >= len(text) else None
        if opened is not None:  # json names the newline, a control character, not the cause
            return None, (f"invalid JSON: the string opened at column {opened} is not closed "
                          "(no closing quote before the line ends)")
        cr = text.find("\r")  # a lone CR ends a record only where the file's start has no LF
        if e.msg.startswith("Extra data") and 0 <= cr <= e.pos:
            return None, (f"invalid JSON: records joined at a lone carriage return (column "
                          f"{cr + 1}): the file mixes line ends (a lone \\r ends lines only "
                          "in a file whose first 64 KiB hold no \\n); end every line with \\n")
        return None, (f"invalid JSON: {e.msg.removesuffix(' at')} "
                      f"(column {min(e.pos, len(text)) + 1})")
    except ValueError:  # Python's limit on an integer's digits (sys.get_int_max_str_digits)
        return None, (f"a number of more than {sys.get_int_max_str_digits()} digits, "
                      "longer than Python reads: not a record")


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value), "a number")
