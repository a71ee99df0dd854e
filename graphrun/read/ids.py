"""Duplicate record ids: an id is its text, so 5 and "5" are one id (npy and Parquet write both
as '5'), "05" and 5 are two. Only ids of records that passed every other check are remembered."""

from __future__ import annotations

import re

import numpy as np


def check_duplicate_ids(ids: np.ndarray | list, positions: np.ndarray, seen: set,
                        problems: dict[int, str]) -> None:
    """Only ids of records that passed every other check are remembered (as Python values:
    an int64 id and the same int are one id). An id is its text: 5 and "5" are one id (npy
    and Parquet write both as '5'), "05" and 5 are two."""
    if isinstance(ids, list):  # JSONL: ints and strings may mix
        ids = _as_compared(ids, seen)
    if not problems:  # the common case, by set operations: no Python step per id
        chunk = ids[positions].tolist() if isinstance(ids, np.ndarray) else (
            [ids[p] for p in positions.tolist()] if len(positions) < len(ids) else list(ids))
        fresh = set(chunk)
        if len(fresh) == len(chunk) and seen.isdisjoint(fresh):
            seen |= fresh
            return
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    for p in positions.tolist():
        if p in problems:
            continue
        rid = ids[p]
        if rid in seen:
            problems[p] = f"duplicate id {rid!r}: an earlier record has the same id"
        else:
            seen.add(rid)


def check_npy_ids(ids: np.ndarray | list, problems: dict[int, str]) -> None:
    """A str id ending in NUL is a problem of its record for npy output: the ids file holds
    fixed-width unicode, which drops trailing NULs ('a' and 'a\\x00' would both read 'a')."""
    if isinstance(ids, np.ndarray):
        if ids.dtype != object:  # int64 ids, or strings numpy has already cut
            return
        ids = ids.tolist()
    for p, rid in enumerate(ids):
        if type(rid) is str and rid.endswith("\x00"):
            problems.setdefault(p, f"id {rid!r} ends in NUL (\\x00), which an npy ids file "
                                   "cannot hold (numpy's strings drop trailing NULs); set "
                                   "output.format jsonl or parquet, or change the id")


_INT_TEXT = re.compile(r"-?(0|[1-9][0-9]*)")
# Markers kept in a file's set of seen ids: it held an int id, a str id, and was made canonical.
_INT_SEEN, _STR_SEEN, _CANONICAL = object(), object(), object()


def _as_compared(ids: list, seen: set) -> list:
    """ids as they are compared. Only once a file has both int and str ids does a str that is
    an int's text become that int (seen ids too, once): until then each is its own text, and
    a Python step per id would cost the common all-str file for nothing."""
    kinds = set(map(type, ids))
    if int in kinds:
        seen.add(_INT_SEEN)
    if str in kinds:
        seen.add(_STR_SEEN)
    if _INT_SEEN not in seen or _STR_SEEN not in seen:
        return ids
    if _CANONICAL not in seen:
        canonical = {_id_key(x) for x in seen}
        seen.clear()
        seen |= canonical
        seen.add(_CANONICAL)
    return [_id_key(x) for x in ids]


def _id_key(rid):
    """A str id that is an int's canonical text compares as that int."""
    if type(rid) is str and len(rid) < 20 and _INT_TEXT.fullmatch(rid):
        return int(rid)
    return rid



def last_repeat(chunks) -> int | None:
    """The last ordinal whose id an earlier record holds too, or None; chunks: (ordinals,
    ids) in file order. Ids compare here as loosely as one process may compare them (an int's
    text as the int), so a record past it never repeats an id one process would find."""
    seen: set = set()
    last = None
    for ordinals, ids in chunks:
        keys = ids.tolist() if isinstance(ids, np.ndarray) else [_id_key(x) for x in ids]
        fresh = set(keys)
        if len(fresh) == len(keys) and seen.isdisjoint(fresh):  # the common case
            seen |= fresh
            continue
        ordinals = ordinals.tolist() if isinstance(ordinals, np.ndarray) else ordinals
        for o, k in zip(ordinals, keys):
            if k in seen:
                last = o
            else:
                seen.add(k)
    return last


def mark_decided(indices: np.ndarray, positions: np.ndarray, decided: np.ndarray,
                 reasons: dict[int, str], problems: dict[int, str]) -> None:
    """The records at `positions` whose ordinal is in `decided` (sorted ordinals, their reasons
    in `reasons`) get that reason, unless they have a problem already."""
    at = positions[np.isin(indices[positions], decided)]
    for p in at.tolist():
        problems.setdefault(p, reasons[int(indices[p])])
