"""Duplicate record ids: an id is its text, so 5 and "5" are one id (npy and Parquet write both
as '5'), "05" and 5 are two. Only ids of records that passed every other check are remembered,
as a fixed 16 bytes each (SeenIds), whatever the ids' length."""

from __future__ import annotations

import numpy as np


class SeenIds:
    """The ids one file's records have held so far: each id's text as a 128-bit keyed hash
    (Python's SipHash of the text and of the text behind a NUL, keyed per process), 16 bytes
    an id in sorted arrays that are merged as they grow (each at least 4 times the next: few
    arrays to search). Two distinct ids of n share a hash with odds about n**2 / 2**129."""

    def __init__(self):
        self._levels: list[tuple[np.ndarray, np.ndarray]] = []  # (hi sorted, lo), largest first

    def __len__(self) -> int:
        return sum(len(hi) for hi, _ in self._levels)

    @property
    def nbytes(self) -> int:
        return sum(hi.nbytes + lo.nbytes for hi, lo in self._levels)

    def add(self, texts: list[str]) -> np.ndarray:
        """texts in file order -> [n] bool: the text is held by an earlier one (in this list or
        added before); the others are added."""
        n = len(texts)
        hi = np.fromiter(map(hash, texts), np.int64, n).view(np.uint64)
        lo = np.fromiter((hash("\0" + t) for t in texts), np.int64, n).view(np.uint64)
        order = np.lexsort((lo, hi))  # [n] stable: of equal keys, the first in file order first
        hi, lo = hi[order], lo[order]
        repeat = np.zeros(n, bool)
        repeat[1:] = (hi[1:] == hi[:-1]) & (lo[1:] == lo[:-1])
        for held_hi, held_lo in self._levels:
            repeat |= _held(held_hi, held_lo, hi, lo)
        if not repeat.all():
            self._insert(hi[~repeat], lo[~repeat])
        out = np.empty(n, bool)
        out[order] = repeat
        return out

    def _insert(self, hi: np.ndarray, lo: np.ndarray) -> None:
        self._levels.append((hi, lo))
        while len(self._levels) > 1 and 4 * len(self._levels[-1][0]) >= len(self._levels[-2][0]):
            small_hi, small_lo = self._levels.pop()
            big_hi, big_lo = self._levels.pop()
            at = np.searchsorted(big_hi, small_hi)  # a linear merge of two sorted arrays
            # one half at a time, the old one let go: 24 bytes an id at the peak, not 32
            big_hi = np.insert(big_hi, at, small_hi)
            big_lo = np.insert(big_lo, at, small_lo)
            self._levels.append((big_hi, big_lo))


def _held(held_hi: np.ndarray, held_lo: np.ndarray, hi: np.ndarray, lo: np.ndarray
          ) -> np.ndarray:
    """[n] bool: (hi, lo) is in the level; hi sorted. Equal his follow each other in the level
    (more than one only where two ids' first halves collide), so each is compared."""
    found = np.zeros(len(hi), bool)
    at = np.searchsorted(held_hi, hi)
    last = len(held_hi) - 1
    while True:
        j = np.minimum(at, last)
        same = (at <= last) & (held_hi[j] == hi)
        if not same.any():
            return found
        found |= same & (held_lo[j] == lo)
        at = at + 1


def id_texts(ids: np.ndarray | list) -> list[str]:
    """Ids as they are compared: each one's text (an int as its decimal digits)."""
    values = ids.tolist() if isinstance(ids, np.ndarray) else ids
    if all(type(x) is str for x in values):
        return values
    return [x if type(x) is str else str(x) for x in values]


def check_duplicate_ids(ids: np.ndarray | list, positions: np.ndarray, seen: SeenIds,
                        problems: dict[int, str]) -> None:
    """The records at `positions` without a problem yet whose id an earlier record held get a
    problem; their ids are remembered."""
    if problems:
        positions = np.array([p for p in positions.tolist() if p not in problems], np.int64)
    values = ids[positions] if isinstance(ids, np.ndarray) else (
        [ids[p] for p in positions.tolist()] if len(positions) < len(ids) else ids)
    values = values.tolist() if isinstance(values, np.ndarray) else values
    repeat = seen.add(id_texts(values))
    for k in np.flatnonzero(repeat).tolist():
        problems[int(positions[k])] = (f"duplicate id {values[k]!r}: an earlier record has "
                                       "the same id")


def one_id_type(ids: np.ndarray | list, kind: tuple[str, object], problems: dict[int, str]
                ) -> np.ndarray | list:
    """ids in the run's one Parquet id type (parquet_id_kind): integers as their text in a run
    of text ids; in a run of integer ids, a record with another id gets a problem."""
    name, first = kind
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        return ids if name == "int" else [str(x) for x in ids.tolist()]
    if name == "str":
        return [str(x) if _integral(x) else x for x in ids]
    for p, rid in enumerate(ids):
        if type(rid) is str:  # an id of another kind is refused as no id already
            problems.setdefault(p, (
                f"id {rid!r} is text, but this run writes its ids to Parquet as integers (the "
                f"input's first id, {first}, is one) and a Parquet column holds one type: give "
                f"every record an integer id, or every record a text id (\"{first}\")"))
        elif type(rid) is int and not -2**63 <= rid < 2**63:  # else its shard's column is text
            problems.setdefault(p, (
                f"id {rid} does not fit the Parquet id column's int64 (the input's first id, "
                f"{first}, is an integer): give it an id from -2**63 to 2**63-1, or every "
                f"record a text id (\"{rid}\")"))
    return ids


def _integral(x) -> bool:
    return (type(x) is int or isinstance(x, np.integer)) and not isinstance(x, np.bool_)


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


def last_repeat(chunks) -> int | None:
    """The last ordinal whose id an earlier record holds too, or None; chunks: (ordinals,
    ids) in file order. Ids compare as one process compares them (by their text), so a record
    past it never repeats an id one process would find."""
    seen = SeenIds()
    last = None
    for ordinals, ids in chunks:
        repeat = np.flatnonzero(seen.add(id_texts(ids)))
        if len(repeat):
            last = int(ordinals[int(repeat[-1])])
    return last


def mark_decided(indices: np.ndarray, positions: np.ndarray, decided: np.ndarray,
                 reasons: dict[int, str], problems: dict[int, str]) -> None:
    """The records at `positions` whose ordinal is in `decided` (sorted ordinals, their reasons
    in `reasons`) get that reason, unless they have a problem already."""
    at = positions[np.isin(indices[positions], decided)]
    for p in at.tolist():
        problems.setdefault(p, reasons[int(indices[p])])
