"""The input formats of the stream step: one reader per file suffix, looked up in READERS.
A reader's module is imported when a file of its format is read (pyarrow for Parquet only).

A reader knows its format only: how many records the file holds (count), what makes the whole
file unreadable (check: an InputError naming the file), and its records [start, stop) as
chunks of Candidates (or Prechecked, where another thread or process checked them) in file
order, about one chunk in memory whatever the file's size. The per-record checks and the
batching are the same for every format (read/records.py, checks.py, stream.py).
first_fields: the field names of a file's first records, read before the stream starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Protocol

from graphrun.base.errors import InputError
from graphrun.read.checks import Prechecked
from graphrun.read.records import Candidates
from graphrun.spec.keys import PipelineSpec
from graphrun.base.tuning import Tuning


class Reader(Protocol):
    suffix: str

    def __init__(self, path: Path, spec: PipelineSpec, tuning: Tuning): ...

    def count(self) -> int: ...

    def check(self) -> None: ...

    def chunks(self, start: int, stop: int | None) -> Iterator[Candidates | Prechecked]: ...


def _jsonl() -> type[Reader]:
    from graphrun.read.formats.jsonl import JsonlReader

    return JsonlReader


def _npy() -> type[Reader]:
    from graphrun.read.formats.npy import NpyReader

    return NpyReader


def _npz() -> type[Reader]:
    from graphrun.read.formats.npz import NpzReader

    return NpzReader


def _parquet() -> type[Reader]:
    from graphrun.read.formats.parquet import ParquetReader

    return ParquetReader


READERS: dict[str, Callable[[], type[Reader]]] = {".jsonl": _jsonl, ".npy": _npy, ".npz": _npz,
                                                  ".parquet": _parquet}
SUFFIXES = tuple(READERS)


def reader_for(spec: PipelineSpec, tuning: Tuning) -> Reader:
    """The reader of spec.data.path, by its suffix; InputError for an unknown one."""
    path = Path(spec.data.path)
    found = READERS.get(path.suffix.lower())
    if found is None:
        raise InputError(f"unknown input format {path.suffix or '(no suffix)'!r}; accepted: "
                         f"{', '.join(SUFFIXES)}", where=str(path))
    return found()(path, spec, tuning)


FIRST_BYTES = 1 << 16  # first_fields reads the records in a JSONL file's first block


def _first_records(path: Path):
    """The records (objects) among a JSONL file's first 64 KiB, in file order."""
    from graphrun.read.formats.jsonl_lines import lines_of
    from graphrun.read.formats.jsonl_parse import parse_line

    with open(path, "rb") as f:
        for line in lines_of(f).readlines(FIRST_BYTES):
            record, _ = parse_line(line) if line.strip() else (None, "")
            if isinstance(record, dict):
                yield record


def first_id(path, id_field: str):
    """The first string or integer id among the records in a JSONL file's first 64 KiB, or
    None (none there, or not a JSONL file)."""
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        return None
    try:
        return next((r[id_field] for r in _first_records(path)
                     if type(r.get(id_field)) in (str, int)), None)
    except Exception:  # noqa: BLE001 - the reader reports an unreadable file as it reads
        return None


def parquet_id_kind(spec) -> tuple[str, object] | None:
    """(kind, the input's first id) for a run that writes Parquet from a JSONL file's ids, so
    that its id column has one type in every shard (pyarrow reads the shards as one table only
    then): "int" where the first id is an integer (a record with another id is refused), "str"
    where it is text (integer ids are written as their text, the one id they are already for
    duplicates). From a Parquet or .npz input's uint64 id column holding ids past int64, "str"
    too: else the shards holding those would write text ids and the others int64. None where
    the ids have one type anyway (ordinals, another column) or the output is not Parquet."""
    if spec.output.format != "parquet" or not spec.data.id_field:
        return None
    if Path(spec.data.path).suffix.lower() != ".jsonl":
        wide = _past_int64(Path(spec.data.path), spec.data.id_field)
        return ("str", None) if wide else None
    first = first_id(spec.data.path, spec.data.id_field)
    if first is None:
        return None
    # a first id past int64 cannot start an int64 column: the ids are written as their text
    return ("int" if type(first) is int and -2**63 <= first < 2**63 else "str"), first


def _past_int64(path: Path, id_field: str) -> bool:
    """Whether a Parquet or .npz file's id column is uint64 with an id of 2**63 or more (read
    from the row groups' statistics where they hold them, else from the column)."""
    import numpy as np

    try:
        if path.suffix.lower() == ".npz":
            with np.load(path, allow_pickle=False) as z:
                ids = z[id_field] if id_field in z.files else None
            return (ids is not None and ids.dtype == np.uint64 and len(ids) > 0
                    and int(ids.max()) >= 2**63)
        if path.suffix.lower() == ".parquet":
            import pyarrow as pa
            import pyarrow.compute as pc
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(path)
            if pf.schema_arrow.field(id_field).type != pa.uint64():
                return False
            column = pf.schema_arrow.get_field_index(id_field)
            for g in range(pf.metadata.num_row_groups):
                stats = pf.metadata.row_group(g).column(column).statistics
                if stats is None or not stats.has_min_max:
                    top = pc.max(pf.read_row_group(g, columns=[id_field]).column(0)).as_py()
                else:
                    top = stats.max
                if top is not None and top >= 2**63:
                    return True
    except Exception:  # noqa: BLE001 - the reader reports an unreadable file as it reads
        return False
    return False


def first_fields(path) -> list[str]:
    """The field names the first records of a JSONL file hold (those in its first 64 KiB, at
    least one), in order of appearance, or a Parquet file's columns; [] where they cannot be
    read cheaply (the run names what is wrong with the file)."""
    path = Path(path)
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(path).names)
        if path.suffix != ".jsonl":
            return []
        names: dict[str, None] = {}
        for record in _first_records(path):
            names.update(dict.fromkeys(record))
        return list(names)
    except Exception:  # noqa: BLE001 - the reader reports an unreadable file as it reads
        return []
