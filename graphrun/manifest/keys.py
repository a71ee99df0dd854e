"""The manifest: what a run did and what every part of it cost. schemas/manifest.schema.json is
generated from these models; every run's manifest.json validates against it."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from graphrun.manifest.sections import Generation, Phases, RayReport, WorkerReport
from graphrun.base.nofollow import open_file
from graphrun.base.phases import utc_now

MANIFEST_VERSION = 1


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Environment(_M):
    graphrun: str
    python: str
    torch: str
    cuda: Optional[str] = Field(None, description="CUDA version torch was built with.")
    gpu: Optional[str] = None
    driver: Optional[str] = None
    host: str
    platform: str
    device: str = Field(..., description="The device the run used.")
    backend: str = Field(..., description="cuda-graph or eager.")
    model_code: Optional[str] = Field(
        None, description="A model.hf or builtin model: whose code ran it. graphrun (its own "
        "Llama or BERT, loading the folder's weights; no transformers import), transformers "
        "(the model.hf class), or builtin.")
    model_code_reason: Optional[str] = Field(
        None, description="Why that code ran a model.hf: the implementation the spec named "
        "(model.hf.implementation: graphrun or transformers), or under auto that graphrun's own "
        "code loads the folder as transformers would, or what it could not load (then "
        "transformers' ran). Null where model_code is null or builtin.")


class BatchCheck(_M):
    passed: bool
    max_abs_err: float
    max_rel_err: float
    failures: list[str] = Field(default_factory=list)


class VerifyResult(_M):
    passed: bool
    max_abs_err: float
    max_rel_err: float
    pad_isolated: Optional[bool] = Field(None, description="null for a bucket of batch 1.")
    pad_positions: Optional[bool] = Field(
        None, description="Records padded along the bucket's other axes give the outputs they "
        "give unpadded (the model called eagerly on them cut to their length); null where the "
        "bucket has no other axis longer than 1, on a lane after the first, where the model "
        "cannot run the shorter shape, or with capture.verify.positions: false.")
    failures: list[str] = Field(default_factory=list)
    real_batch: Optional[BatchCheck] = Field(
        None, description="Replay vs eager on the first real batch that reached the bucket, "
        "on the lane that ran it: at setup when the reader held it by then, else in the stream "
        "(captured buckets only; once per bucket: null on its other lanes, and if none "
        "reached it).")


class LaneReport(_M):
    verify: Optional[VerifyResult] = Field(
        None, description="This lane's graph of the bucket checked against eager (synthetic "
        "inputs, pad isolation, the first real batch it ran); null with capture.verify off.")


class BucketReport(_M):
    name: str = Field(..., description='"batch=8" or "batch=8,seq=64".')
    sizes: dict[str, int]
    status: Literal["captured", "eager", "skipped", "unused"] = Field(
        ..., description="captured: replays a CUDA graph; eager: runs the model eagerly (the "
        "eager backend, e.g. the CPU, or capture.on_failure: eager after a failed capture or "
        "verification; reason says which); skipped: dropped (capture.memory_budget_mib), no "
        "batch ran in it; unused: capture.lazy and no batch selected it, so it was never set "
        "up (no warm-up, capture or verification).")
    reason: Optional[str] = Field(None, description="Why the bucket is eager, skipped or "
                                  "unused, or why its setup on first use failed.")
    set_up: Optional[Literal["setup", "first_use"]] = Field(
        None, description="When the bucket was set up (warm-up, capture where the backend "
        "captures, verification): setup, before the stream; first_use, with capture.lazy, when "
        "the first batch that selected it came (the launching thread waited for the batches in "
        "flight, then set it up on every lane; that time is the phase `bucket setup on first "
        "use`, within stream_s, not in setup_s); null when it never was (skipped, unused).")
    first_use_batch: Optional[int] = Field(
        None, description="set_up: first_use: the batch (0-based, of this attempt; a batch "
        "that data.oversize: split cuts counts once per part) that needed it.")
    warmup_s: Optional[float] = None
    capture_s: Optional[float] = None
    memory_bytes: Optional[int] = Field(None, description="Pool growth while capturing it.")
    lanes: list[LaneReport] = Field(
        default_factory=list, description="One entry per lane the bucket ran on: a lane is a "
        "set of static buffers with the bucket's graph captured on them. The overlapped stream "
        "uses two lanes in turn, so that one batch's copies run beside the other's replay; "
        "capture_s and memory_bytes include every lane's capture. Empty for a skipped bucket.")
    batches: int = 0
    records: int = 0
    padded_rows: int = 0
    padded_positions: dict[str, int] = Field(
        default_factory=dict, description="Per bucket axis other than batch: the slots (rows "
        "x the axis's size) that held padding, in real and padded rows alike (token slots for "
        "seq).")
    latency_us: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="phase (h2d, replay, d2h, e2e) -> percentile -> us. "
        "e2e over every batch; h2d, replay and d2h (CUDA events on a GPU) over the bucket's "
        "first 256 batches and one in 8 after them.")
    eager_us: Optional[float] = Field(None, description="Median eager step (report.baseline).")
    replay_us: Optional[float] = Field(None, description="Median replay measured beside it.")
    speedup: Optional[float] = None


class Totals(_M):
    records_in: int = Field(..., description="The whole run, every attempt (--resume) "
                            "included: what the output folder holds; in = out + rejected.")
    records_out: int
    records_rejected: int
    earlier_records_out: int = Field(
        0, description="Of records_out, those committed by the attempts this one resumed "
        "(0 unless --resume): records_out - earlier_records_out came out of this attempt.")
    earlier_records_rejected: int = Field(
        0, description="Of records_rejected, those committed by the attempts this one resumed.")
    batches: int = Field(..., description="Batches this attempt ran; like buckets[] and "
                         "latency_us, this attempt alone. A resumed attempt starts at the "
                         "batch holding the first record not committed, so up to one batch "
                         "runs again (its committed rows are not written twice).")
    wall_s: float = Field(..., description="From the start of the run to its manifest: "
                          "setup_s, stream_s, and the output folder's preparation, the wait "
                          "for the input's hash and the last commits.")
    process_wall_s: Optional[float] = Field(
        None, description="From the process's start (phases.process_start says how it was "
        "known) to the run's end: the manifest's content gathered, after which only its "
        "assembly, write, fsync and rename follow. The phases' seconds add up to it. From "
        "the CLI it includes the interpreter's start and the imports; from the Python API, "
        "whatever the process did before run(). Null in manifests of older graphrun.")
    time_to_first_output_s: Optional[float] = Field(
        None, description="From the process's start to the first batch's outputs handed to "
        "the writer (written into the open shard, not yet committed: shards commit every "
        "output.rows_per_file rows). Null when no batch ran.")
    setup_s: float = Field(..., description="Model build, buffers, capture and verify.")
    stream_s: float = Field(0.0, description="The streaming time: from the end of setup to "
                            "the last batch written.")
    input_hash_s: float = Field(0.0, description="How long the run waited for the input file's "
                                "sha256 (for --resume's check that it did not change), which "
                                "a child process computes beside setup: --resume waits for it "
                                "before setup, a new run after setup, before streaming.")
    records_per_s: float = Field(..., description="This attempt's records out "
                                 "(records_out - earlier_records_out) / its streaming time, "
                                 "which starts after setup; the input's first batch is read "
                                 "during setup, beside it.")
    capture_s: float
    capture_memory_bytes: int
    padding_ratio: float = Field(..., description="Padded rows / rows run.")
    padding_ratio_positions: dict[str, float] = Field(
        default_factory=dict, description="Per bucket axis other than batch: padded positions "
        "/ positions run (token slots for seq), padded rows included.")
    device_busy_fraction: Optional[float] = Field(
        None, description="GPU runs: the compute stream's time (per bucket, batches x mean "
        "replay time; CUDA events) / wall time of the streaming part of the run; big copies "
        "run beside it, on their own streams. An upper bound: when the device has caught up "
        "with the host, a stall of the launching thread between two marks of a batch (waiting "
        "for the GIL, say) counts as replay time.")
    device_idle_fraction: Optional[float] = Field(
        None, description="GPU runs: 1 - device_busy_fraction, the share of the streaming wall "
        "time the device waited for the host.")
    overlapped: Optional[bool] = Field(
        None, description="Whether the stream ran overlapped (stager, launching and completer "
        "threads) or serially. Null when the stream never started.")
    overlap_reason: Optional[str] = Field(
        None, description="What chose the path: set (GRAPHRUN_OVERLAP or run()'s overlap), or "
        "the device's default (overlapped on a GPU, serial on the CPU).")
    host_phase_s: dict[str, float] = Field(
        default_factory=dict, description="Host seconds per phase of the stream, summed per "
        "thread: read and stage (the stager: parsing and checking records, padding them into "
        "pinned slots), read_wait and launch (the launching thread: waiting for staged "
        "batches, enqueuing copies and replays), device_wait and write (the completer: "
        "waiting for results, cutting and writing them). Serially they add up to the "
        "streaming time; overlapped the threads run side by side and the busiest one, with "
        "its waits, bounds the rate.")
    texts_truncated: Optional[int] = Field(
        None, description="data.text jobs: records whose text was longer than text_max_tokens "
        "and was cut to it (data.text.truncate: from the right, or from the left for a "
        "generation job's prompts, whose end is kept), as this attempt read them; the summary "
        "names it. Null without data.text.")
    text_max_tokens: Optional[int] = Field(
        None, description="data.text jobs: the tokens a text may hold (data.text.max_length, "
        "else the largest seq bucket, else the tokenizer's model_max_length).")

    @model_validator(mode="before")
    @classmethod
    def _drop_retired(cls, data):
        # kept: manifest_version 1 files may hold this retired key, and --resume of such a
        # completed run must read its manifest back, not run and rewrite it
        if isinstance(data, dict) and "overlap_trials" in data:
            data = {k: v for k, v in data.items() if k != "overlap_trials"}
        return data


class BucketPlan(_M):
    """What `buckets: {axis: auto}` planned at the start of the run (graphrun.plan.auto)."""

    auto_axes: list[str]
    buckets: dict[str, list[int]] = Field(..., description="The planned lists of the auto axes.")
    sample_records: int = Field(..., description="Records of the input's start planned from.")
    graphs: int = Field(..., description="Graphs of all axes together; a generation spec's: its "
                        "prefill and decode graphs.")
    decode_graphs: Optional[int] = Field(
        None, description="Of those, a generation spec's decode graphs (one per row count); "
        "null for any other spec.")
    max_graphs: int = Field(..., description="buckets_max_graphs, as it applied.")
    padding_waste: float = Field(..., description="1 - real / padded work (rows x positions) "
                                 "of the sample in the planned buckets; a generation spec's: "
                                 "of the prefills its prompts are packed into, simulated "
                                 "(docs/generation.md).")
    memory_budget: Optional[str] = Field(
        None, description="capture.memory_budget_mib: how it bounded the plan (the largest "
        "batch value allowed, and what the estimate came from); null without a budget.")

    _shapes: Any = PrivateAttr(None)  # the sample's batch shapes, for capture.lazy; not written

    @property
    def shapes(self):
        """The sample's distinct batch shapes [u, axes] (records, then the longest record per
        other axis), or None."""
        return self._shapes

    def keep_shapes(self, shapes) -> None:
        self._shapes = shapes


class Grouping(_M):
    """data.group_by_length: the padding it saved, counted from the lengths this run read (a
    resumed run: this attempt's records) in the spec's buckets, as the runner picks them."""

    window: int = Field(..., description="data.group_by_length: records per window.")
    windows: int = Field(..., description="Windows read.")
    padded_positions: dict[str, int] = Field(
        ..., description="Per variable axis: padded positions of the grouped batches.")
    padded_positions_input_order: dict[str, int] = Field(
        ..., description="Per variable axis: padded positions the same records would have "
        "taken batched in input order (data.batch_size each).")
    positions_run: dict[str, int] = Field(
        ..., description="Per variable axis: all positions run (real and padded), grouped.")
    positions_run_input_order: dict[str, int] = Field(
        ..., description="Per variable axis: all positions run, batched in input order.")
    padding_saved: dict[str, float] = Field(
        ..., description="Per variable axis: 1 - grouped / input-order padded positions.")


class FileEntry(_M):
    path: str
    rows: int = Field(..., description="Records this file holds outputs of. An openai_batch "
                      "file also holds the error lines of the rejected requests among them, "
                      "which totals.records_rejected counts, not this.")
    sha256: str
    bytes: int


DigestSource = Literal["read", "cache", "job"]


class Digests(_M):
    """Where the run's sha256 of its input and of its model's files came from: --resume
    compares them, and reading a large file to hash it can outlast a short job's setup."""

    input: Optional[DigestSource] = Field(
        None, description="read: the file was read and hashed (beside setup); cache: its "
        "digest was kept from an earlier run of the same file, by its real path, size, "
        "modification time (ns), inode and device (GRAPHRUN_HASH_CACHE; files of 64 MiB and "
        "more); job: the job's publisher (the --gpus parent, rank 0) hashed it for its "
        "workers; null: not known (the run ended before).")
    model: dict[str, Optional[DigestSource]] = Field(
        default_factory=dict, description="The same per model file, by role (weights, "
        "exported, torchscript, target, hf/<file>), as run.json's model_sha256.")


class Manifest(_M):
    manifest_version: Literal[1] = MANIFEST_VERSION
    status: Literal["completed", "interrupted", "failed"]
    error: Optional[str] = None
    name: str
    started_at: str
    finished_at: str
    spec: dict[str, Any] = Field(..., description="The resolved spec, overrides applied.")
    spec_sha256: str = Field(..., description="sha256 of the resolved spec less output.dir "
                             "(what the run computes; --resume compares it).")
    input: dict[str, Any] = Field(..., description="path, format, sha256, slice.")
    environment: Optional[Environment] = Field(None, description="null when the run "
                                               "failed before its device was set up.")
    buckets: list[BucketReport]
    totals: Totals
    files: list[FileEntry]
    rejects: dict[str, Any] = Field(..., description="path and count of rejects.jsonl; "
                                    "path is null when no record was rejected (no file).")
    resumed_from: Optional[int] = Field(None, description="First input record of this run "
                                        "when it resumed an earlier one.")
    bucket_plan: Optional[BucketPlan] = Field(None, description="The lists planned for "
                                              "`auto` bucket axes; null when none is auto.")
    grouping: Optional[Grouping] = Field(None, description="data.group_by_length: the "
                                         "padding it saved; null when off.")
    phases: Optional[Phases] = Field(None, description="The process's time as named "
                                     "phases; null in manifests of older graphrun.")
    digests: Optional[Digests] = Field(None, description="Where the input's and the model "
                                       "files' sha256 came from; null in manifests of older "
                                       "graphrun and of a job of several workers.")
    generation: Optional[Generation] = Field(
        None, description="A generation job's tokens, times and graphs (a spec with "
        "generate:); null for one forward pass per record.")
    warnings: list[str] = Field(default_factory=list)
    ray: Optional[RayReport] = Field(None, description="Runs with --ray only (absent from "
                                     "single-process manifests): the actors and Ray's stats; "
                                     "buckets and totals then sum every actor's, and "
                                     "totals.stream_s is Ray's execution of the whole "
                                     "dataset: actors starting and setting up included.")
    workers: list[WorkerReport] = Field(
        default_factory=list, description="A job of several worker processes (--gpus N, "
        "torchrun): one entry per worker, in input order. The totals add theirs up, except "
        "stream_s (the slowest worker's), records_per_s (the job's records out this attempt / "
        "that stream_s), setup_s, capture_s and capture_memory_bytes (the largest worker's: "
        "they ran side by side); buckets gather every worker's batches, their latency "
        "percentiles taken over all of them. Empty for one process.")

    # Set on the manifest run() returns for --resume of a run that was already complete.
    _already_complete: bool = PrivateAttr(False)

    @property
    def already_complete(self) -> bool:
        """This manifest is a completed run's, found by --resume: nothing was run."""
        return self._already_complete

    def found_complete(self) -> "Manifest":
        self._already_complete = True
        return self


def run_manifest(spec, *, input_sha256: str | None, rejected: int, rejects_path: str | None,
                 spec_json: dict | None = None, input_slice: list | None = None, **fields
                 ) -> Manifest:
    """A manifest as each of its writers builds it (a run, a job's merge, a --ray run): the
    spec and its digest, the input, rejects.jsonl and the finish time said one way; `fields`
    the rest (status, error, started_at, buckets, totals, sections). spec_json: the resolved
    spec as the run recorded it (default: the spec's own)."""
    spec_json = spec.model_dump(mode="json") if spec_json is None else spec_json
    data = Path(spec.data.path)
    source = {"path": str(data), "format": data.suffix.lstrip("."), "sha256": input_sha256}
    if input_slice is not None:
        source["slice"] = input_slice
    return Manifest(name=spec.name, finished_at=utc_now(), spec=spec_json,
                    spec_sha256=spec_digest(spec_json), input=source,
                    rejects={"path": rejects_path, "count": rejected}, **fields)


def spec_digest(spec_json: dict) -> str:
    """sha256 of the resolved spec less output.dir: where the outputs go is no part of what the
    run computes, so a run folder copied or moved elsewhere still resumes."""
    output = {k: v for k, v in (spec_json.get("output") or {}).items() if k != "dir"}
    return hashlib.sha256(json.dumps({**spec_json, "output": output},
                                     sort_keys=True).encode()).hexdigest()


def environment(device, backend: str, model_code: tuple[str | None, str | None] = (None, None)
                ) -> Environment:
    import sys

    import torch

    from graphrun.base.version import __version__

    gpu = driver = None
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        driver = _driver_version()
    return Environment(graphrun=__version__, python=sys.version.split()[0],
                       torch=torch.__version__, cuda=torch.version.cuda, gpu=gpu, driver=driver,
                       host=socket.gethostname(), platform=platform.platform(),
                       device=str(device), backend=backend, model_code=model_code[0],
                       model_code_reason=model_code[1])


def _driver_version() -> Optional[str]:
    try:
        with open("/proc/driver/nvidia/version") as f:
            line = f.readline()
        return line.split("Kernel Module")[1].split()[0] if "Kernel Module" in line else None
    except (OSError, IndexError):
        return None


def write_manifest(manifest: Manifest, path) -> None:
    """Written under a temporary name and renamed, so a reader never sees half a manifest."""
    tmp = f"{path}.tmp"
    try:
        with open_file(tmp, "w") as f:
            # a single-process manifest has no ray key at all
            f.write(manifest.model_dump_json(indent=2, exclude=None if manifest.ray else {"ray"}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: no half-written temp file left beside the outputs
        Path(tmp).unlink(missing_ok=True)
        raise


def all_rejected(out_dir: Path, count: int) -> str:
    """The warning for a run whose every record was rejected, with the first reason."""
    try:
        with open(out_dir / "rejects.jsonl") as f:
            first = json.loads(f.readline())
        why = f" (the first, {first.get('where')}: {first.get('reason')})"
    except (OSError, ValueError, AttributeError):
        why = ""
    return (f"every record ({count}) was rejected{why}: no outputs were written; "
            "rejects.jsonl has each reason")
