"""run(spec): the whole job, file -> outputs + manifest. The spine of graphrun; one screen.

spec -> Runner (engine/: model, lanes of static buffers, capture, verify) -> stream (read,
check, batch) -> feed (stage, launch, result on three threads) -> write (shards, rejects,
journal) -> manifest.
"""

from __future__ import annotations

import datetime as dt
import json
import signal
import time
from array import array
from pathlib import Path

import numpy as np

from .auto_buckets import resolve_auto
from .errors import GraphrunError, Interrupted, OutputError
from .manifest import (FileEntry, Manifest, Totals, all_rejected,
                       completed_manifest, environment, spec_digest, write_manifest)
from .progress import Progress, count_records, summary_table
from .engine import Runner
from .engine.timing import noise_floor_us, percentiles, spread_warning
from .feed import feed_stream, slot_count
from .overlap import (MEASURE, OVERLAP_ENV, OverlapTrial, overlap_choice, overlap_reason,
                      overlapped_path)
from .padding import position_ratios
from .stop_signals import StopSignals
from .stream import ReadAhead, read_batches
from .tuning import Tuning
from .folder import FilesHash, locked, model_files, prepare_out_dir, write_fingerprint
from .journal import InputHash
from .latencies import open_latencies
from .outputs import shard_suffixes
from .write import ShardWriter


def run(spec, *, out: str | Path | None = None, resume: bool = False, overwrite: bool = False,
        show: bool = False, start: int = 0, stop: int | None = None,
        overlap: bool | str | None = None, tuning: Tuning | None = None,
        accept_model_change: bool = False) -> Manifest:
    """Run the pipeline; returns the manifest (also written to <out>/manifest.json).

    start/stop select a slice of the input's records (one process per GPU reads its own).
    overlap: True for the overlapped data path (feed.py), False for the serial one, "measure"
    to time both on the stream and keep the faster (overlap.OverlapTrial); None (the default)
    takes GRAPHRUN_OVERLAP (on | off | measure | auto) from the environment, and auto is
    overlapped on a GPU and measured on the CPU, where torch's own threads run the model on
    every core and neither path always wins (benchmarks/RESULTS.md). tuning: the reader's and
    writer's threads and chunk sizes (default: Tuning.from_machine(), from the cores and the
    GRAPHRUN_* variables). accept_model_change: --resume goes on although a model file
    (weights, archive, target source) changed, for a change that does not alter outputs.

    The output folder is locked for the whole run (folder.FolderLock). A signal before the
    stream starts stops the run at once; during the stream the batch in flight finishes."""
    job, overlap = new_job(spec, out, overlap, tuning)
    stop_signal = StopSignals()
    try:
        with stop_signal, locked(job.out_dir):
            manifest = run_locked(job, stop_signal, resume=resume, overwrite=overwrite,
                                  accept_model_change=accept_model_change, show=show,
                                  start=start, stop=stop, overlap=overlap)
    except KeyboardInterrupt:  # a signal before the run's folder was ready: nothing written
        raise Interrupted(stop_signal.signum or signal.SIGINT) from None
    finally:
        job.stop_hashes()
    if getattr(manifest, "_already_complete", False):
        return manifest
    if show:
        summary_table(manifest, shown=job.printed)
    if stop_signal.signum:
        raise Interrupted(stop_signal.signum)
    return manifest


def run_locked(job: "RunState", stop_signal: StopSignals, *, resume: bool, overwrite: bool,
               accept_model_change: bool, show: bool, start: int, stop: int | None,
               overlap) -> Manifest:
    """The run, its output folder locked: prepare it, set up, stream, and write the manifest
    whatever happens (a write of it failing on a full disk fails the run with one message,
    not a second traceback over the first error)."""
    spec, out_dir = job.spec, job.out_dir  # buckets: auto planned
    # The input and model files are hashed beside setup (journal.InputHash); --resume needs
    # them first, to compare, and a new run records them in run.json before streaming.
    fingerprint = {"spec_sha256": job.spec_sha,
                   "input_sha256": job.input_hash.result() if resume else None,
                   "model_sha256": job.model_hash.result() if resume else None,
                   "slice": [start, stop],
                   "shards": shard_suffixes(spec.output.format, list(spec.outputs))}
    done = (completed_manifest(out_dir, fingerprint, with_model=not accept_model_change)
            if resume else None)
    if done is not None:  # --resume of a completed run: nothing to do, nothing rewritten
        return done
    resume_point, start = open_out_dir(job, fingerprint, resume, overwrite, start,
                                       accept_model_change)
    progress = Progress(show, total=count_records(spec, start, stop) if show else None)
    try:
        run_stream(job, fingerprint, resume_point, start, stop, overlap, progress,
                   stop_signal, show)
        job.status = "interrupted" if stop_signal.signum else "completed"
    except GraphrunError as err:
        job.status, job.error = "failed", str(err)
        raise
    except OSError as err:  # the disk: full, gone, not writable
        job.status = "failed"
        job.error = f"writing {out_dir} failed: {err}"
        raise OutputError(f"{job.error}; committed shards are intact, free space or fix "
                          "the folder and run again with --resume") from err
    except KeyboardInterrupt:
        # A signal during setup, or a second one while streaming: stopped at once, the batch
        # in flight dropped. What is complete is still committed below, so this is an
        # interruption like the first signal's (manifest, exit 130/143, --resume).
        job.status = "interrupted"
        raise Interrupted(stop_signal.signum or signal.SIGINT) from None
    except BaseException as err:  # not a user error: a bug in graphrun or in the model
        job.error = f"{type(err).__name__}: {err}"  # the manifest says why it failed
        raise
    finally:
        stop_signal.hold()  # a signal now must not cut the commit and manifest below short
        manifest = job.finish(progress)
    if job.late_error is not None:  # the stream ended well, but its bookkeeping did not
        raise OutputError(f"{job.late_error}; committed shards are intact, free space or fix "
                          "the folder and run again with --resume")
    return manifest


def new_job(spec, out, overlap, tuning: Tuning | None) -> tuple["RunState", object]:
    """The run's state, its spec's `buckets: auto` planned (auto_buckets.py), and the overlap
    choice (the caller's, else GRAPHRUN_OVERLAP's; None: by the device)."""
    how = "set by run()'s overlap" if overlap is not None else f"set by {OVERLAP_ENV}"
    overlap = overlap_choice(overlap)
    spec, bucket_plan = resolve_auto(spec)
    out_dir = Path(out).resolve() if out else spec.output.dir
    job = RunState(spec, out_dir, spec.model_dump(mode="json"))
    job.bucket_plan, job.overlap_how = bucket_plan, how
    job.tuning = tuning or Tuning.from_machine()  # the reader's and writer's threads and chunks
    return job, overlap


def open_out_dir(job: "RunState", fingerprint: dict, resume: bool, overwrite: bool,
                 start: int, accept_model_change: bool = False):
    """The output folder made ready (or its committed part found, for --resume); returns the
    resume point and the first input ordinal to read."""
    try:
        resume_point = prepare_out_dir(
            job.out_dir, resume=resume, overwrite=overwrite, fingerprint=fingerprint,
            input_path=job.spec.data.path, model=job.model_files,
            accept_model_change=accept_model_change)
    except OSError as err:
        raise OutputError(f"cannot use output folder {job.out_dir}: {err.strerror or err}; "
                          "pick a folder you can write to (--out or output.dir)") from err
    if resume_point is not None:
        # Re-read from the start of the batch that held the last committed row, so batches
        # (and their buckets) are as before; the records below next_index are not counted again.
        job.resumed_from = job.count_from = resume_point.next_index
        start = max(start, resume_point.start)
        job.records_in = resume_point.rows + resume_point.rejects
        job.earlier = (resume_point.rows, resume_point.rejects)
    return resume_point, start


def run_stream(job: "RunState", fingerprint: dict, resume_point, start: int, stop, overlap,
               progress, stop_signal, show: bool) -> None:
    """Setup beside the first batch's reading, then the stream. What it opens goes on `job`,
    which closes it whatever happens (RunState.finish)."""
    spec, out_dir = job.spec, job.out_dir
    # the first batch is read while the runner sets up: for a Parquet file, its first
    # row groups decode meanwhile instead of keeping the device waiting (stream.py)
    job.reader = ReadAhead(read_batches(spec, start=start, stop=stop, tuning=job.tuning))
    job.runner = runner = Runner(spec, log=job.print_and_warn if show else job.warn)
    if spec.report.baseline == "eager":
        runner.measure_baseline()
    job.writer = writer = ShardWriter(spec, out_dir, resume=resume_point, tuning=job.tuning)
    job.latencies = open_latencies(out_dir / "latencies.jsonl",
                                   keep_below=start if resume_point else None)
    job.batches_before = job.latencies.lines_before
    writer.on_hand_over = job.latencies.flush  # a shard's batches logged before it commits
    if fingerprint["input_sha256"] is None:
        # not beside the stream: reading the file to hash it slows the stream's reads
        job.record_hashes(fingerprint)
    if overlap is None:
        overlap = True if runner.cuda else MEASURE
        job.overlap_how = "the default on a GPU" if runner.cuda else "the default on the CPU"
    if overlap is not False:  # the overlapped path's pinned slots: setup, not the stream
        runner.host_slots(slot_count(runner.slot_bytes))
    job.stream_t0 = time.perf_counter()
    stop_signal.streaming()  # from here a signal lets the batch in flight finish
    if overlap == MEASURE:
        overlap = job.trial = OverlapTrial()
    else:
        job.overlapped = overlap
    job.host_s = feed_stream(
        runner, job.reader, writer, oversize=spec.data.oversize,
        on_batches=lambda ran, n, first: job.log_batches(job.latencies, ran, n, first),
        on_read=lambda rb: progress.advance(job.count(rb)),
        should_stop=lambda: bool(stop_signal.signum), start=start, overlap=overlap)
    # Full shards commit in the background: the stream is over once they are
    # journaled (and a commit that failed fails the run here, with its manifest).
    writer.wait_for_commits()


class RunState:
    """What the spine accumulates for the manifest."""

    def __init__(self, spec, out_dir: Path, spec_json: dict):
        self.spec, self.out_dir, self.spec_json = spec, out_dir, spec_json
        self.spec_sha = spec_digest(spec_json)
        self.t0 = time.perf_counter()
        self.input_hash = InputHash(spec.data.path)  # for --resume: the same input
        self.model_files = model_files(spec.model, spec.base_dir)
        self.model_hash = FilesHash(self.model_files)  # for --resume: the same model
        self.input_sha: str | None = None
        self.late_error: str | None = None  # writing the manifest or latencies failed
        self.started = _now()
        self.status, self.error = "failed", None
        self.records_in = self.records_out = self.rejected = self.batches = 0
        self.batches_before = 0  # latencies.jsonl lines kept from the run this one resumes
        self.resumed_from = None
        self.earlier = (0, 0)  # (rows, rejects) committed by the attempts this one resumes
        self.count_from = 0  # records below it were committed by the run this one resumes
        self.runner = self.writer = self.latencies = self.reader = None  # open while streaming
        self.stream_t0 = None
        self.files = []
        self.stream_s = 0.0
        self.warnings: list[str] = []
        self.printed: set[str] = set()  # warnings already printed while running
        self.samples: dict = {}  # bucket -> phase -> [us]
        self.bucket_batches: dict[str, int] = {}  # bucket -> batches (timed or not)
        self.host_s: dict[str, float] = {}
        self.overlapped: bool | None = None
        self.trial: OverlapTrial | None = None  # overlap measured: what it measured
        self.overlap_how: str | None = None  # who chose the path: the caller or the default
        self.bucket_plan = None  # buckets: auto: what was planned (auto_buckets.py)
        self.tuning = None  # the reader's and writer's threads and chunks (tuning.py)

    def finish(self, progress) -> Manifest:
        """Close what the stream opened, commit, and write the manifest (whatever happened).
        A write that fails here (a full disk) is kept in late_error, and the manifest's temp
        file removed: it must not hide the error that ended the stream."""
        self.stream_s = time.perf_counter() - self.stream_t0 if self.stream_t0 else 0.0
        if self.reader is not None:
            self.reader.close()
        progress.close()
        if self.latencies is not None:
            try:
                self.latencies.close()
            except OSError as err:
                self.fail_late(f"writing {self.out_dir / 'latencies.jsonl'} failed: {err}")
        if self.writer:
            # interrupted: only complete shards are committed, so that --resume writes the
            # same shards as an uninterrupted run; a failure commits all it has before it
            try:
                self.files = self.writer.close(partial=self.status != "interrupted")
            except OSError as err:
                self.fail_late(f"writing {self.out_dir} failed: {err}")
                self.files = self.writer.committed_files()
            self.records_out = self.writer.rows_written
            self.rejected = self.writer.rejects_written
        self.settle_hash()
        self.settle_counts()
        manifest = self.manifest()
        path = self.out_dir / "manifest.json"
        try:
            write_manifest(manifest, path)
        except OSError as err:
            Path(f"{path}.tmp").unlink(missing_ok=True)
            self.fail_late(f"writing {path} failed: {err}")
        if self.runner:
            self.runner.close()
        return manifest

    def fail_late(self, error: str) -> None:
        if self.status != "failed":  # the first error is the one the user sees
            self.status, self.error = "failed", error
            self.late_error = error

    def stop_hashes(self) -> None:
        self.input_hash.stop()
        self.model_hash.stop()

    def count(self, rb) -> int:
        """Count a record batch's records and rejects (those not committed by an earlier run)."""
        if self.count_from == 0:  # not a resume: all of them, without a pass over indices
            new = len(rb.indices) + len(rb.rejects)
        else:
            new = int(np.count_nonzero(rb.indices >= self.count_from)) + sum(
                r.index >= self.count_from for r in rb.rejects)
        self.records_in += new
        return new

    def record_hashes(self, fingerprint: dict) -> None:
        """run.json gets the input's and model's hashes, waited for: before the stream starts,
        so before any journal line (a run.json without them means nothing was committed)."""
        fingerprint["input_sha256"] = self.input_sha = self.input_hash.result()
        fingerprint["model_sha256"] = self.model_hash.result()
        write_fingerprint(self.out_dir, fingerprint)

    def settle_hash(self) -> None:
        """The manifest's input hash: known once streaming started; a run that failed before
        (in setup, say) stops the hashing instead of waiting for it."""
        self.input_sha = self.input_hash.stop()

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

    def manifest(self) -> Manifest:
        runner, spec = self.runner, self.spec
        ps = spec.report.percentiles
        buckets, capture_s, capture_mem, rows_run, padded = [], 0.0, 0, 0, 0
        for report in (runner.bucket_reports() if runner else []):
            samples = self.samples.get(report.name, {})
            report.latency_us = {ph: percentiles(v, ps) for ph, v in samples.items()}
            buckets.append(report)
            capture_s += report.capture_s or 0.0
            capture_mem += report.memory_bytes or 0
            rows_run += report.records + report.padded_rows
            padded += report.padded_rows
            for phase, values in samples.items():
                floor = noise_floor_us(phase, runner.cuda)
                w = floor is not None and spread_warning(
                    values, f"bucket {report.name} {phase}", floor)
                if w:
                    self.warnings.append(w)
        wall = time.perf_counter() - self.t0
        busy = (min(1.0, self.device_s() / self.stream_s)
                if self.stream_s and runner and runner.cuda else None)
        totals = Totals(
            records_in=self.records_in, records_out=self.records_out,
            records_rejected=self.rejected, batches=self.batches, wall_s=wall,
            setup_s=runner.setup_s if runner else 0.0, stream_s=self.stream_s,
            input_hash_s=self.input_hash.waited_s,
            earlier_records_out=self.earlier[0], earlier_records_rejected=self.earlier[1],
            records_per_s=((self.records_out - self.earlier[0]) / self.stream_s
                           if self.stream_s else 0.0),
            capture_s=capture_s, capture_memory_bytes=capture_mem,
            padding_ratio=padded / rows_run if rows_run else 0.0,
            padding_ratio_positions=position_ratios(buckets),
            device_busy_fraction=busy,
            device_idle_fraction=None if busy is None else 1.0 - busy,
            overlapped=overlapped_path(self.trial, self.overlapped),
            overlap_reason=overlap_reason(self.trial, self.overlapped, self.overlap_how),
            overlap_trials=self.trial.rounds if self.trial
            else [], host_phase_s=self.host_s)
        env = environment(runner.device, runner.backend) if runner else None
        return Manifest(
            status=self.status, error=self.error, name=spec.name, started_at=self.started,
            finished_at=_now(), spec=self.spec_json, spec_sha256=self.spec_sha,
            input={"path": str(spec.data.path), "format": spec.data.path.suffix.lstrip("."),
                   "sha256": self.input_sha},
            environment=env, buckets=buckets, totals=totals,
            files=[FileEntry(**vars(f)) if not isinstance(f, dict) else FileEntry(**f)
                   for f in self.files],
            rejects={"path": "rejects.jsonl" if (self.out_dir / "rejects.jsonl").exists()
                     else None, "count": self.rejected},
            resumed_from=self.resumed_from, warnings=self.warnings,
            bucket_plan=self.bucket_plan)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
