"""The output formats of the write step: one sink per output.format, looked up in SINKS; a
sink's module is imported when a run writes its format (pyarrow for Parquet only).

A sink writes one shard's rows into temp files and, at finish(), completes and closes them and
hands back (temp path, final name). Making them durable (hash, fsync, rename, journal) is the
committer's work, off the writer's thread (write.py), so finish() does no fsync.

A shard can also be committed while open: checkpoint() hands back (temp path, size) whose first
`size` bytes hold the rows so far, and a sink made with rows=N reopens those files (cut back to
those sizes) holding N rows and writes on to the same bytes as one never stopped.
"""

from __future__ import annotations

from concurrent.futures import Executor
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from graphrun.base.tuning import Tuning

Outputs = dict[str, "np.ndarray | list[np.ndarray]"]


class Sink(Protocol):
    suffix: str
    # takes the writer's row pool (threads writing rows at offsets) and its pwrite (DiskSteps)
    uses_row_pool: bool
    # takes the committer's (hashers, syncers) as `ahead`, and after finish() lists in
    # `digests` (temp path -> ahead.RunningDigest) the files it hashed as it wrote them
    hashes_ahead: bool
    # what it keeps for checkpoint() beside its temp files (rows_log.py); finish() leaves
    # them, the committer removes them with the shard's commit
    logs: list[Path]

    def __init__(self, out_dir: Path, stem: str, rows_per_file: int, shapes: dict,
                 tuning: Tuning, pool: Executor | None = None, rows: int = 0): ...

    @staticmethod
    def check(outputs: dict) -> None:
        """Raise OutputError for outputs (spec.outputs) this format cannot store."""

    def add(self, ids, outputs: Outputs) -> None: ...

    def checkpoint(self) -> list[tuple[Path, int]]: ...

    def leave(self) -> None:
        """Close its files and keep them: an open journal line committed their first bytes."""

    def abort(self) -> None: ...

    def finish(self) -> list[tuple[Path, str]]: ...


def _npy() -> type[Sink]:
    from graphrun.write.sinks.npy import NpySink

    return NpySink


def _jsonl() -> type[Sink]:
    from graphrun.write.sinks.jsonl import JsonlSink

    return JsonlSink


def _parquet() -> type[Sink]:
    from graphrun.write.sinks.parquet import ParquetSink

    return ParquetSink


def _openai_batch() -> type[Sink]:
    from graphrun.write.sinks.openai_batch import OpenAIBatchSink

    return OpenAIBatchSink


SINKS: dict[str, Callable[[], type[Sink]]] = {"npy": _npy, "jsonl": _jsonl, "parquet": _parquet,
                                              "openai_batch": _openai_batch}


def sink_for(spec) -> type[Sink]:
    """The sink of spec.output.format (openai_batch's bound to the spec's endpoint and model)."""
    sink = SINKS[spec.output.format]()
    return sink.bound(spec) if hasattr(sink, "bound") else sink


def shard_suffixes(fmt: str, outputs: list[str]) -> list[str]:
    """What follows `part-00000.` in a shard's file names, for the format: npy writes ids and
    one file per output, the others one file."""
    if fmt == "npy":
        return ["ids.npy"] + [f"{name}.npy" for name in outputs]
    return ["jsonl" if fmt == "openai_batch" else fmt]
