"""Record ids as a shard collects them, and the Python values json writes."""

from __future__ import annotations

import numpy as np


def plain(x):
    """numpy scalars to the Python values json can write."""
    return x.item() if isinstance(x, np.generic) else x


def id_array(ids: list) -> np.ndarray:
    """int64 when every id is an integer (one numpy conversion, not a Python test per id),
    else their strings."""
    if not len(ids):
        return np.zeros(0, np.int64)
    try:
        a = np.asarray(ids)
    except (ValueError, OverflowError):  # ragged or huge: not a plain integer column
        a = None
    if a is not None and a.dtype.kind in "iu" and (a.dtype.kind == "i" or a.max() < 2**63):
        return a.astype(np.int64, copy=False)
    return np.array([str(x) for x in ids])


class Ids:
    """A shard's ids as the batches gave them. Batches of int64 arrays (the reader's ordinals
    and integer ids) stay arrays and are joined by one concatenate at the end; anything else
    is turned into Python values, as ids always were (same files either way)."""

    def __init__(self):
        self.parts: list = []
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, ids) -> None:
        """ids: a list, or an array (copied: the caller may reuse its own)."""
        if not len(ids):
            return
        if isinstance(ids, np.ndarray):
            ids = ids.copy() if ids.dtype == np.int64 else ids.tolist()
        self.parts.append(ids)
        self.count += len(ids)

    def _all_arrays(self) -> bool:
        return all(isinstance(p, np.ndarray) for p in self.parts)

    def values(self) -> list:
        return [x for p in self.parts for x in (p.tolist() if isinstance(p, np.ndarray) else p)]

    def array(self) -> np.ndarray:
        """What id_array makes of all the ids."""
        if self.parts and self._all_arrays():  # int64 arrays: add() made lists of others
            return np.concatenate(self.parts)
        return id_array(self.values())
