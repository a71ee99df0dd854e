"""Sections of the manifest beside one run's counts (manifest.py): where the process's time
went (phases), and the parts of a job spread out: the workers of `--gpus N` / torchrun, the
actors of a `--ray` run."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Phase(_M):
    name: str
    s: float = Field(..., description="Seconds of the main thread in this phase, phases "
                     "nested in it not counted (they are phases of their own).")


class BucketPhases(_M):
    bucket: str
    lane: int = Field(..., description="0: the first lane; 1: the overlapped stream's second.")
    within: Optional[str] = Field(
        None, description="null: set up before the stream, its seconds are part of the "
        "top-level warm-up, capture and verify; `bucket setup on first use` (capture.lazy): "
        "set up mid-stream, its seconds are part of that top-level phase.")
    warmup_s: float = 0.0
    capture_s: float = 0.0
    verify_s: float = 0.0


class Phases(_M):
    """Where the process's time went, from its start to the manifest (totals.process_wall_s)."""

    process_start: Literal["proc", "psutil", "graphrun import"] = Field(
        ..., description="How the process's start was known: proc (/proc/self/stat, 10 ms "
        "ticks), psutil, or graphrun import (no OS start time: the interpreter's start and "
        "the imports before graphrun are missing from the phases and from process_wall_s).")
    top: list[Phase] = Field(
        ..., description="A flat list, each phase once, in the order first entered (a phase "
        "entered again, such as warm-up per bucket, adds up), then `other`: the time no "
        "phase covered. They never overlap and add up to totals.process_wall_s. The main "
        "thread's phases: interpreter and imports (the CLI's: the interpreter, graphrun, "
        "torch; with the Python API, `before run()`: what the process did before), "
        "spec, bucket plan (buckets: auto), input hash start (the input's and model files' "
        "hashing started beside the run), output folder (preparing it, run.json), reader "
        "start (its thread reads the first batch beside setup), input hash wait, cuda "
        "context, imports (transformers) or imports (timm) (the model library's import, "
        "its lazily imported model code included), model build, weights load, to device, "
        "compile (wrapping only: "
        "torch.compile compiles in the first warm-up), first call and buffers, warm-up, "
        "capture, verify (every bucket and lane set up before the stream), bucket setup (the "
        "rest of it), eager baseline, output open (starting the threads that open the writer, "
        "latencies.jsonl and count the records for the progress bar beside setup, and "
        "waiting for them after it), host slots (pinned), stream, bucket setup on first use "
        "(capture.lazy: the buckets set up mid-stream, when a batch first selected them: "
        "their warm-up, capture, verification and eager baseline, all of it; not the stream's), "
        "drain and fsync (the last commits, closing the writer), manifest write (gathering "
        "its content: the run's end).")
    buckets: list[BucketPhases] = Field(
        default_factory=list, description="warm-up, capture and verify per bucket and lane: "
        "a breakdown of top-level phases, not more time. Per name, the seconds of the "
        "entries with within null add up to the top-level phase of that name; those of the "
        "entries within `bucket setup on first use` are part of that phase.")


class RayActor(_M):
    """One actor of a --ray run's pool: its Runner and what it ran."""

    host: str
    pid: int
    device: str
    backend: str
    setup_s: float = Field(..., description="Its Runner's model build, buffers, capture and "
                           "verify.")
    capture_s: float
    batches: int
    records: int = Field(..., description="Records it wrote out.")
    rejected: int
    busy_s: float = Field(..., description="Time in its batches (check, run, report).")
    warnings: list[str] = Field(default_factory=list)


class RayReport(_M):
    """What Ray ran (`graphrun run --ray`)."""

    ray_version: str
    address: Optional[str] = Field(None, description="The --address asked for; null: "
                                   "RAY_ADDRESS, or a local cluster.")
    workers: int = Field(..., description="Actors in the pool (one GPU each on a GPU spec).")
    nodes: int = Field(..., description="Nodes of the cluster alive at the end.")
    actors: list[RayActor]
    dataset_stats: str = Field(..., description="Ray Data's own statistics of the run "
                               "(Dataset.stats()), as text; empty when it failed.")


class WorkerReport(_M):
    """One worker of a job spread over several processes (--gpus, torchrun)."""

    rank: int
    device: Optional[str] = Field(None, description="The device it was given: "
                                  "cuda:LOCAL_RANK, or cpu.")
    status: Literal["completed", "interrupted", "failed"]
    error: Optional[str] = None
    slice: list[int] = Field(..., description="[start, stop): the input records of its share.")
    shards: list[int] = Field(..., description="[first, end): the shard numbers its share may "
                              "use; a share with rejects writes fewer.")
    records_in: int
    records_out: int
    records_rejected: int
    batches: int = 0
    setup_s: float = Field(0.0, description="Its model build, capture and verify.")
    capture_s: float = 0.0
    stream_s: float = 0.0
    records_per_s: float = Field(0.0, description="Its records out this attempt / its stream_s.")
