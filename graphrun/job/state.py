"""What a run records and what it holds open, apart.

RunRecord: what the run records (counts, timings, warnings, its status), each filled by the
step that owns it, and turned into the manifest at the end whatever happened. RunResources:
what the run holds open (the hashes in flight, the reader, the writer, latencies.jsonl, the
runner), closed at the end whatever happened (finish)."""

from __future__ import annotations

import hashlib
import json
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from graphrun.base.errors import GraphrunError
from graphrun.feed.protocols import Engine
from graphrun.manifest.latency import noise_floor_us, percentiles, spread_warning
from graphrun.write.disk import write_failure, write_remedy
from graphrun.write.folder import FilesHash, model_files, write_fingerprint
from graphrun.write.journal import SPEC_COPY, InputHash
from graphrun.manifest.keys import (Digests, FileEntry, Manifest, Totals, all_rejected,
                                    environment, run_manifest, spec_digest)
from graphrun.manifest.sections import BucketPhases, Phase, Phases
from graphrun.engine.padding import padding_ratio, position_ratios
from graphrun.base.phases import PART_PHASES, PhaseClock, phase, utc_now
from graphrun.base.tuning import Tuning

if TYPE_CHECKING:  # the parts pull in the engine and torch, which a --gpus parent needs not
    from graphrun.job.parts import JobParts


class JobRunner(Protocol):
    """What the job asks of its engine: a forward pass's engine/runner.Runner or a generation
    job's generate/runner.GenerationRunner (spine.run_stream picks one, by the spec, once).
    launcher: its place in the feed (feed/protocols.Engine)."""

    device: Any
    backend: str
    cuda: bool
    model_code: tuple
    setup_s: float
    launcher: Engine

    def bucket_reports(self) -> list: ...  # manifest.keys.BucketReport per bucket or part size

    @property
    def default_path(self) -> tuple[bool, str]: ...  # (overlapped, why) where nobody chose

    # the manifest's sections of this engine's own (generation's), beside every job's
    def manifest_sections(self, percentiles, rejected: int = 0, truncated: int = 0) -> dict: ...

    def close(self) -> None: ...


class Digest(Protocol):
    """A hash a run waits for: its own (journal.InputHash, folder.FilesHash) or a part of the
    record its job hashed once (scale/input_digest.SharedHash)."""

    def result(self) -> Any: ...

    def stop(self) -> Any: ...

    @property
    def source(self) -> Any:
        """Where the digest came from (manifest.keys.Digests), shaped as result()."""


@dataclass(frozen=True)
class RunHashes:
    """Where a run's input and model digests come from: its own hashing, or its job's."""

    input: Digest
    model: Digest

    @classmethod
    def own(cls, path: Path, model: dict[str, Path],
            keep_bytes: int = Tuning.hash_keep_bytes) -> "RunHashes":
        """keep_bytes: from this size a digest is kept between runs (write/digests.py)."""
        return cls(InputHash(Path(path), keep_bytes), FilesHash(model, keep_bytes))


@dataclass(eq=False)
class RunRecord:
    """What a run records for its manifest; the spine's steps fill it as they go."""

    spec: Any
    out_dir: Path
    spec_json: dict  # the resolved spec as run.json and the manifest record it
    clock: PhaseClock = field(default_factory=PhaseClock)  # the process's time, as phases
    bucket_plan: Any = None  # buckets: auto: what was planned (plan/auto.py)
    t0: float = field(default_factory=time.perf_counter)
    started: str = field(default_factory=utc_now)
    # how it ended
    status: str = "failed"
    error: str | None = None
    late_error: str | None = None  # writing the manifest or latencies failed
    late_remedy: str | None = None  # what to do about it
    input_sha: str | None = None
    # counts
    records_in: int = 0
    records_out: int = 0
    rejected: int = 0
    batches: int = 0
    files: list = field(default_factory=list)
    # --resume: what the attempts before this one committed
    resumed_from: int | None = None
    count_from: int = 0  # records below it were committed by the run this one resumes
    earlier: tuple = (0, 0)  # (rows, rejects) committed by the attempts this one resumes
    batches_before: int = 0  # latencies.jsonl lines kept from the run this one resumes
    # the stream
    overlapped: bool | None = None
    overlap_how: str | None = None  # who chose the path: the caller or the default
    stream_t0: float | None = None
    stream_s: float = 0.0
    host_s: dict = field(default_factory=dict)  # host seconds per phase and thread (feed)
    samples: dict = field(default_factory=dict)  # bucket -> phase -> [us]
    bucket_batches: dict = field(default_factory=dict)  # bucket -> batches (timed or not)
    padding: Any = None  # data.group_by_length: the padding saved (grouping.PaddingCount)
    cuts: Any = None  # data.text: the texts truncate cut (text.TextCuts)
    warnings: list = field(default_factory=list)
    printed: set = field(default_factory=set)  # warnings already printed while running

    def __post_init__(self):
        self.spec_sha = spec_digest(self.spec_json)

    def resumed(self, point) -> None:
        """--resume: re-read from the start of the batch that held the last committed row, so
        batches (and their buckets) are as before; the records below next_index are not
        counted again."""
        self.resumed_from = self.count_from = point.next_index
        self.records_in = point.rows + point.rejects
        self.earlier = (point.rows, point.rejects)

    def written(self, writer, files: list) -> None:
        """The writer's counts, once it is closed."""
        self.files = files
        self.records_out = writer.rows_written
        self.rejected = writer.rejects_written

    def fail_late(self, path: Path, err: OSError) -> None:
        if self.status != "failed":  # the first error is the one the user sees
            self.status = "failed"
            self.error = self.late_error = write_failure(path, err)
            self.late_remedy = write_remedy(path, err)

    def count(self, rb) -> int:
        """Count a record batch's records and rejects (those not committed by an earlier run)."""
        new = self.new(rb.indices) + self.new([r.index for r in rb.rejects])
        self.records_in += new
        return new

    def new(self, ordinals) -> int:
        """How many of these records were not committed by an earlier run."""
        if self.count_from == 0:  # not a resume: all of them, without a pass over them
            return len(ordinals)
        return int(np.count_nonzero(np.asarray(ordinals, np.int64) >= self.count_from))

    def settle_counts(self) -> None:
        """A completed run's records_in is counted as read, independently of the writer's
        counts, so in = out + rejected checks them. A stopped run accounts only for what it
        committed; what it read beyond that is read again by --resume."""
        committed = self.records_out + self.rejected
        if self.status != "completed" and self.records_in != committed:
            self.warnings.append(
                f"{self.records_in - committed} records read after the last commit were not "
                "committed; --resume reads them again")
            self.records_in = committed
        if self.status == "completed" and self.rejected and not self.records_out:
            self.warnings.append(all_rejected(self.out_dir, self.rejected))

    def print_and_warn(self, msg: str) -> None:
        """Shown as it comes (a terminal or a log), so the summary need not repeat it."""
        print(msg)
        self.printed.add(msg.removeprefix("warning: "))
        self.warn(msg)

    def warn(self, msg: str) -> None:
        if msg.startswith("warning: "):
            self.warnings.append(msg[len("warning: "):])

    def log_batches(self, latencies, ran: list, n: int, first: int) -> None:
        """A batch's outputs are in the writer: its timings go to latencies.jsonl."""
        self.clock.output_handed()
        for bucket, times in ran:
            self.batches += 1
            name = bucket.name if bucket else "oversize-eager"
            phases = self.samples.setdefault(name, {})
            for phase, us in times.items():
                phases.setdefault(phase, array("d")).append(us)  # 8 bytes a batch per phase
            self.bucket_batches[name] = self.bucket_batches.get(name, 0) + 1
            latencies.write(json.dumps({"batch": self.batches_before + self.batches,
                                        "first": first, "bucket": name, "records": n,
                                        **{f"{p}_us": round(v, 2) for p, v in times.items()}})
                            + "\n")

    def device_s(self) -> float:
        """The compute stream's busy time: per bucket, its batches times their mean replay
        (phases are timed on a sample of batches, timing.sampled; the copies run beside the
        replays, on their own streams)."""
        total = 0.0
        for name, n in self.bucket_batches.items():
            replay = self.samples.get(name, {}).get("replay")
            if replay:
                total += n * sum(replay) / len(replay) / 1e6
        return total

    def _overlap_reason(self) -> str | None:
        """What chose the stream's path (manifest totals.overlap_reason)."""
        if self.overlapped is None:
            return None
        return f"{'overlapped' if self.overlapped else 'serial'}: {self.overlap_how}"

    def manifest(self, runner, input_hash_s: float, digests: Digests | None = None) -> Manifest:
        spec = self.spec
        ps = spec.report.percentiles
        buckets, capture_s, capture_mem = [], 0.0, 0
        for report in (runner.bucket_reports() if runner else []):
            samples = self.samples.get(report.name, {})
            report.latency_us = {ph: percentiles(v, ps) for ph, v in samples.items()}
            buckets.append(report)
            capture_s += report.capture_s or 0.0
            capture_mem += report.memory_bytes or 0
            for phase, values in samples.items():
                floor = noise_floor_us(phase, runner.cuda)
                w = floor is not None and spread_warning(
                    values, f"bucket {report.name} {phase}", floor)
                if w:
                    self.warnings.append(w)
        wall = time.perf_counter() - self.t0
        busy = (min(1.0, self.device_s() / self.stream_s)
                if self.stream_s and runner and runner.cuda else None)
        env = environment(runner.device, runner.backend, runner.model_code) if runner else None
        process_wall = self.clock.end()  # what follows is the manifest's few assignments
        totals = Totals(
            records_in=self.records_in, records_out=self.records_out,
            records_rejected=self.rejected, batches=self.batches, wall_s=wall,
            setup_s=runner.setup_s if runner else 0.0, stream_s=self.stream_s,
            input_hash_s=input_hash_s,
            earlier_records_out=self.earlier[0], earlier_records_rejected=self.earlier[1],
            records_per_s=((self.records_out - self.earlier[0]) / self.stream_s
                           if self.stream_s else 0.0),
            capture_s=capture_s, capture_memory_bytes=capture_mem,
            padding_ratio=padding_ratio(buckets),
            padding_ratio_positions=position_ratios(buckets),
            device_busy_fraction=busy,
            device_idle_fraction=None if busy is None else 1.0 - busy,
            overlapped=self.overlapped, overlap_reason=self._overlap_reason(),
            host_phase_s=self.host_s,
            process_wall_s=process_wall, time_to_first_output_s=self.clock.first_output_s(),
            texts_truncated=self.cuts.count if self.cuts else None,
            text_max_tokens=self.cuts.length if self.cuts else None)
        return run_manifest(
            spec, spec_json=self.spec_json, input_sha256=self.input_sha, rejected=self.rejected,
            rejects_path="rejects.jsonl" if (self.out_dir / "rejects.jsonl").exists() else None,
            status=self.status, error=self.error, started_at=self.started,
            environment=env, buckets=buckets, totals=totals,
            files=[FileEntry(**vars(f)) if not isinstance(f, dict) else FileEntry(**f)
                   for f in self.files],
            resumed_from=self.resumed_from, warnings=self.warnings,
            bucket_plan=self.bucket_plan, digests=digests,
            grouping=self.padding.report() if self.padding else None, phases=self.phases(),
            **(runner.manifest_sections(ps, self.rejected,
                                        truncated=self.cuts.count if self.cuts else 0)
               if runner else {}))

    def phases(self) -> Phases:
        """The clock's phases (after its end()): the flat list, and warm-up, capture and
        verify per bucket and lane."""
        clock = self.clock
        parts = [BucketPhases(bucket=bucket, lane=lane, within=clock.within.get((bucket, lane)),
                              **{f"{p.replace('-', '')}_s": got.get(p, 0.0) for p in PART_PHASES})
                 for (bucket, lane), got in clock.parts.items()]
        return Phases(process_start=clock.t0_how,
                      top=[Phase(name=n, s=s) for n, s in clock.top()], buckets=parts)


class RunResources:
    """What a run holds open, and what its setup was given to open it with; closed by
    finish() whatever happened (the hashes stopped by stop_hashes(), after the folder's lock)."""

    def __init__(self, spec, out_dir: Path, *, tuning, device_start=None,
                 hashes: RunHashes | None = None, parts: JobParts | None = None):
        self.spec, self.out_dir = spec, out_dir
        if parts is None:
            from graphrun.job.parts import JobParts

            parts = JobParts()
        self.parts = parts  # the runner, reader, stream and writer it builds
        self.tuning = tuning  # the reader's and writer's threads and chunks (tuning.py)
        self.device_start = device_start  # the CUDA context begun beside setup
        self.model_files = model_files(spec.model, spec.base_dir)
        # for --resume: the same input and model; a job's worker is given the digests its job
        # hashed once (scale/local/input_digest.py)
        hashes = hashes or RunHashes.own(spec.data.path, self.model_files,
                                         tuning.hash_keep_bytes)
        self.input_hash, self.model_hash = hashes.input, hashes.model
        self.place = None  # a job's worker: where its shards go (journal.ShardPlace)
        self.fingerprint = None  # run.json's, once record_hashes wrote it
        self.runner: JobRunner | None = None  # open while streaming, as the four below
        self.writer = self.latencies = self.reader = None
        self.finished = None  # a generation job's write/finished.FinishedLog

    def record_hashes(self, record: RunRecord, fingerprint: dict) -> None:
        """run.json gets the input's hash, waited for before the stream starts (hashing the
        file beside the stream would slow its reads), and the model's before the first shard
        is handed to the committer, so before any journal line (a run.json without them means
        nothing was committed): a large model's files are hashed beside the stream."""
        with phase("input hash wait"):
            fingerprint["input_sha256"] = record.input_sha = self.input_hash.result()
        with phase("output folder"):
            write_fingerprint(self.out_dir, fingerprint)
        self.fingerprint, then = fingerprint, self.writer.on_hand_over

        def model_hashed() -> None:  # on the writer's thread, before a shard's commit
            self.record_model_hash()
            if then is not None:
                then()

        self.writer.on_hand_over = model_hashed

    def run_key(self, fingerprint: dict) -> str:
        """The run's fingerprint with its input's and model's hashes (waited for), as one
        sha256: what finished.jsonl's lines are kept for."""
        whole = {k: v for k, v in fingerprint.items() if k != SPEC_COPY}
        whole.update(input_sha256=self.input_hash.result(), model_sha256=self.model_hash.result())
        return hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()

    def record_model_hash(self) -> None:
        """The model's hash into run.json, once (record_hashes)."""
        if self.fingerprint is not None and self.fingerprint["model_sha256"] is None:
            self.fingerprint["model_sha256"] = self.model_hash.result()
            write_fingerprint(self.out_dir, self.fingerprint)

    def close_outputs(self, record: RunRecord, progress) -> None:
        """The reader stopped, latencies.jsonl closed, the writer's last shard committed."""
        if self.reader is not None:
            self.reader.close()
        progress.close()
        if self.latencies is not None:
            try:
                self.latencies.close()
            except OSError as err:
                record.fail_late(self.out_dir / "latencies.jsonl", err)
        if self.writer:
            # interrupted: the shard being written is committed open (its rows so far), so
            # that --resume writes it on into the same shards as an uninterrupted run; a
            # failure commits all it has before it
            try:
                files = self.writer.close(partial=record.status != "interrupted")
            except OSError as err:
                record.fail_late(self.out_dir, err)
                files = self.writer.committed_files()
            record.written(self.writer, files)
        if self.finished is not None:  # after the writer's last commit: what it holds is out
            self.finished.close(completed=record.status == "completed")
            if self.finished.error is not None:
                record.warn(f"{self.finished.path.name} could not be read or written "
                            f"({self.finished.error}): completions that finished before an "
                            "earlier one were not kept against an interrupt")

    def stop_hashes(self) -> None:
        self.input_hash.stop()
        self.model_hash.stop()

    def finish(self, record: RunRecord, progress) -> Manifest:
        """Close what the stream opened, commit, and write the manifest (whatever happened).
        A write that fails here (a full disk) is kept in late_error, and the manifest's temp
        file removed: it must not hide the error that ended the stream."""
        record.stream_s = time.perf_counter() - record.stream_t0 if record.stream_t0 else 0.0
        with phase("drain and fsync"):
            self.close_outputs(record, progress)
        if record.status == "completed":  # one that committed no shard: --resume finds it done
            try:
                self.record_model_hash()
            except (GraphrunError, OSError):  # run.json without it: a --resume hashes again
                pass
        # the manifest's input hash: known once streaming started; a run that failed before
        # (in setup, say) stops the hashing instead of waiting for it
        record.input_sha = self.input_hash.stop()
        record.settle_counts()
        with phase("manifest write"):  # the run's end: the manifest's content complete
            manifest = record.manifest(self.runner, self.input_hash.waited_s, Digests(
                input=self.input_hash.source, model=self.model_hash.source))
        path = self.out_dir / "manifest.json"
        try:
            self.parts.write_manifest(manifest, path)
        except OSError as err:
            Path(f"{path}.tmp").unlink(missing_ok=True)
            record.fail_late(path, err)
        if self.runner:
            self.runner.close()
        return manifest
