"""The spine's collaborators, as one typed object: run() takes the defaults below; a caller
(a test, an embedding) hands in its own (a slower setup, a counted stream, a writer that fails)
instead of patching the spine's names."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from graphrun.base.phases import LIBRARY_IMPORTS, phase
from graphrun.feed.loop import feed_stream
from graphrun.job.progress import count_records
from graphrun.manifest.keys import write_manifest
from graphrun.plan.auto import resolve_auto
from graphrun.read.stream import read_batches
from graphrun.write.latencies import open_latencies
from graphrun.write.shards import ShardWriter


ENGINE_IMPORTS = LIBRARY_IMPORTS.format("graphrun's engine")


def _engine_module(name: str) -> ModuleType:
    """The engine's module, imported on a run's first use in this process as a phase of its
    own (a caller of run() in Python pays it there; the CLI imported it among its imports)."""
    if name in sys.modules:
        return sys.modules[name]
    with phase(ENGINE_IMPORTS):
        return importlib.import_module(name)


def forward_runner(spec, **kwargs):
    """engine/runner.Runner, imported when a forward pass runs (a generation job needs none)."""
    return _engine_module("graphrun.engine.runner").Runner(spec, **kwargs)


def generation_runner(spec, **kwargs):
    """generate/runner.GenerationRunner, imported when a generation job runs."""
    return _engine_module("graphrun.generate.runner").GenerationRunner(spec, **kwargs)


def import_parts(spec) -> None:
    """The modules this spec's run uses and the defaults import on first use (its engine, its
    input's reader, its output's sink), imported now: the CLI times them as imports, and the
    reader's thread does not import while setup runs."""
    from graphrun.read.formats import READERS
    from graphrun.write.sinks import SINKS

    if spec.generate is not None:  # set by data.chat and openai_batch too
        import graphrun.generate.runner  # noqa: F401
    else:
        import graphrun.engine.runner  # noqa: F401
    reader = READERS.get(Path(spec.data.path).suffix.lower())
    if reader is not None:  # an unknown suffix: the reader says so, where it is asked
        reader()
    SINKS[spec.output.format]()


@dataclass(frozen=True)
class JobParts:
    """What run(spec) builds and calls, each with the signature of its default."""

    plan: Callable = resolve_auto  # the spec's `auto` bucket axes, planned from its data
    runner: Callable = forward_runner  # the engine of a forward-pass spec
    generation_runner: Callable = generation_runner  # the engine of a spec with `generate:`
    read_batches: Callable = read_batches  # the input file -> record batches
    count_records: Callable = count_records  # the progress bar's total
    feed_stream: Callable = feed_stream  # batches -> engine -> writer
    writer: Callable = ShardWriter  # the output shards, rejects and journal
    open_latencies: Callable = open_latencies  # latencies.jsonl
    write_manifest: Callable = write_manifest  # manifest.json, whatever happened

    def engine(self, spec) -> Callable:
        """The engine that runs this spec: a generation job's, or a forward pass's."""
        return self.generation_runner if spec.generate is not None else self.runner
