""".npy input: one array [N, ...] for the spec's one input, memory-mapped, no ids (the record's
ordinal is its id)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from graphrun.base.errors import InputError
from graphrun.read.formats.dense import (check_array, dense_chunks, npy_too_short,
                                         read_npy_header)
from graphrun.read.records import Candidates
from graphrun.spec.keys import PipelineSpec
from graphrun.base.tuning import Tuning


class NpyReader:
    suffix = ".npy"

    def __init__(self, path: Path, spec: PipelineSpec, tuning: Tuning):
        self.path, self.spec, self.tuning = path, spec, tuning

    def count(self) -> int:
        """Records in the file, from its header."""
        with open(self.path, "rb") as f:
            shape, _, _ = read_npy_header(f, self.path.name)
        return shape[0] if shape else 0

    def check(self) -> None:
        """Whole-file problems (one input, no ids, a numeric array of the input's shape)."""
        self._open()

    def chunks(self, start: int, stop: int | None) -> Iterator[Candidates]:
        name, array = self._open()
        yield from dense_chunks(self.spec, self.path.name, {name: array}, None, len(array),
                                start, stop, self.tuning)

    def _open(self) -> tuple[str, np.ndarray]:
        spec, where = self.spec, self.path.name
        if len(spec.inputs) != 1:
            raise InputError(f"a .npy file holds one array but the spec has inputs "
                             f"{', '.join(spec.inputs)}; use .npz with one array per input",
                             where=where)
        if spec.data.id_field:
            raise InputError(f"a .npy file holds no ids but data.id_field is "
                             f"{spec.data.id_field!r}; use .npz with an id array or drop "
                             "id_field", where=where)
        try:
            array = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - a damaged header raises all sorts (TokenError)
            _check_size(self.path, where)  # not .npy, or cut short: said so, not numpy's words
            raise InputError(f"cannot read the .npy file: {e}", where=where) from e
        name = next(iter(spec.inputs))
        check_array(spec, name, array, where)
        return name, array


def _check_size(path: Path, where: str) -> None:
    """An InputError where the file is no .npy (numpy calls it pickled data, and suggests
    allow_pickle) or holds fewer bytes than its header's shape and dtype need."""
    try:
        with open(path, "rb") as f:
            shape, _, dtype = read_npy_header(f, where)
            offset = f.tell()
    except InputError:
        raise
    except Exception:  # noqa: BLE001 - a damaged header (TokenError): np.load's message names it
        return
    short = npy_too_short(shape, dtype, path.stat().st_size - offset, "the file")
    if short:
        raise InputError(f"{short}: the file is truncated (a copy or download cut short?); "
                         "write it again", where=where)
