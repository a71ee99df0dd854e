"""One manifest.json (and one rejects.jsonl) for a job, from its workers' when they end.

A worker that ended on its own wrote its manifest; one that died (kill -9) did not, and its
journal says what it committed. Totals add the workers' up; buckets gather every worker's
batches, their latency percentiles taken over the workers' latencies.jsonl lines of this
attempt; the per-worker section says who ran where, and how fast.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from graphrun.base.errors import OutputError
from graphrun.manifest.latency import percentiles
from graphrun.write.disk import write_failure, write_remedy
from graphrun.write.journal import REJECTS, fsync_path
from graphrun.manifest.keys import (BucketReport, FileEntry, Manifest, Totals, run_manifest,
                                    write_manifest)
from graphrun.manifest.sections import WorkerReport, merged_generation
from graphrun.engine.padding import padding_ratio, position_ratios
from graphrun.write.job_layout import committed, manifest_since, shares, worker_dir
from graphrun.base.nofollow import open_file


def read_worker(top: Path, rank: int) -> Manifest | None:
    return read_manifest(worker_dir(top, rank))


def read_manifest(folder: Path) -> Manifest | None:
    try:
        return Manifest.model_validate_json((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def merge(top: Path, spec, mark: dict, outcomes: list, devices: list[str], t0: float,
          started: str, since: float) -> Manifest:
    """Write and return the job's manifest. outcomes[rank]: None where the worker's manifest
    says how it ended, else (status, why) (watch.outcome: killed by a signal, say). A manifest
    older than `since` (time.time()) is of a worker complete before this attempt: its records
    count as earlier, its timings not."""
    manifests, current, reports = [], [], []
    for rank, ((start, stop, first, end), died) in enumerate(zip(shares(mark), outcomes)):
        m = None if died else read_worker(top, rank)
        manifests.append(m)
        current.append(m if m is not None and manifest_since(top, rank, since) else None)
        reports.append(worker_report(top, rank, m, died, devices[rank], (start, stop),
                                     (first, end), old=m is not None and current[-1] is None))
    done = [m for m in manifests if m is not None]
    if not any(outcomes) and all(m is not None and m.status == "completed" and c is None
                                 for m, c in zip(manifests, current)):
        # --resume of a complete job: no worker ran, so its manifest (timings included) stays
        before = read_manifest(top)
        if before is not None and before.status == "completed":
            return before.found_complete()
    buckets = merge_buckets(top, current, spec.report.percentiles)
    files = sorted(all_files(top, mark, manifests), key=lambda f: f.path)
    try:
        rejected = merge_rejects(top, mark, manifests)
    except OSError as err:
        raise OutputError(f"merging the workers' rejects: {write_failure(top, err)}; "
                          f"{write_remedy(top, err)}") from err
    failed = [r for r in reports if r.status == "failed"]
    status = ("failed" if failed else "interrupted"
              if any(r.status == "interrupted" for r in reports) else "completed")
    first = done[0] if done else None
    env = next((m.environment for m in done if m.environment is not None), None)
    if env is not None:
        env = env.model_copy(update={"device": ",".join(devices)})
    manifest = run_manifest(
        spec, input_sha256=first.input.get("sha256") if first else None,
        input_slice=mark.get("slice"), rejected=rejected,
        rejects_path=REJECTS if rejected else None,
        status=status, error=failed[0].error if failed else None, started_at=started,
        environment=env, buckets=buckets, totals=totals(reports, current, buckets, t0),
        files=files,
        resumed_from=min((m.resumed_from for m in done if m.resumed_from is not None),
                         default=None),
        bucket_plan=first.bucket_plan if first else None,
        warnings=[f"rank {r}: {w}" for r, m in enumerate(manifests) if m for w in m.warnings],
        workers=reports, generation=merged_generation([m and m.generation for m in current]))
    try:
        write_manifest(manifest, top / "manifest.json")
    except OSError as err:
        raise OutputError(f"writing the job's manifest: {write_failure(top, err)}; "
                          f"{write_remedy(top, err)}") from err
    return manifest


def worker_report(top: Path, rank: int, m: Manifest | None, died: tuple | None, device: str,
                  cut: tuple, shard_range: tuple, old: bool = False) -> WorkerReport:
    common = dict(rank=rank, device=device, slice=list(cut), shards=list(shard_range))
    if old:  # complete before this attempt: nothing ran
        t = m.totals
        return WorkerReport(**common, status=m.status, records_in=t.records_in,
                            records_out=t.records_out, records_rejected=t.records_rejected)
    if m is not None:
        t = m.totals
        error = f"failed: {m.error}" if m.status == "failed" and m.error else m.error
        return WorkerReport(**common, status=m.status, error=error, records_in=t.records_in,
                            records_out=t.records_out, records_rejected=t.records_rejected,
                            batches=t.batches, setup_s=t.setup_s, capture_s=t.capture_s,
                            stream_s=t.stream_s, records_per_s=t.records_per_s)
    point = committed(top, rank, cut[0], shard_range[0])
    rows, rejects = (point.rows, point.rejects) if point else (0, 0)
    status, why = died or ("failed", "ended without writing its manifest")
    return WorkerReport(**common, status=status, error=why,
                        records_in=rows + rejects, records_out=rows, records_rejected=rejects)


def all_files(top: Path, mark: dict, manifests: list) -> list[FileEntry]:
    out = []
    for rank, ((start, _, first, _), m) in enumerate(zip(shares(mark), manifests)):
        if m is not None:
            out += m.files
        elif (point := committed(top, rank, start, first)) is not None:
            out += [FileEntry(**vars(f)) for f in point.files]
    return out


def merge_rejects(top: Path, mark: dict, manifests: list) -> int:
    """rejects.jsonl: the workers' in rank order, which is input order (a dead worker's up to
    its last commit); returns the count. Replaced whole, through a temp file."""
    parts, count = [], 0
    for rank, ((start, _, first, _), m) in enumerate(zip(shares(mark), manifests)):
        path = worker_dir(top, rank) / REJECTS
        data = path.read_bytes() if path.exists() else b""
        if m is None:  # died: what its last commit covers
            point = committed(top, rank, start, first)
            data = data[:point.rejects_bytes if point else 0]
        parts.append(data)
        count += data.count(b"\n")
    target = top / REJECTS
    if not count:
        target.unlink(missing_ok=True)
        return 0
    tmp = top / f"{REJECTS}.tmp"
    try:
        with open_file(tmp, "wb") as f:
            for data in parts:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:  # a full disk: no half-written temp file left beside the outputs
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(top)
    return count


def merge_buckets(top: Path, manifests: list, ps: list) -> list[BucketReport]:
    """Per bucket across workers: counts summed, capture the slowest worker's, latency
    percentiles over every worker's timed batches of this attempt."""
    merged: dict[str, BucketReport] = {}
    samples: dict[str, dict[str, list]] = {}
    for rank, m in enumerate(manifests):
        if m is None:
            continue
        for b in m.buckets:
            have = merged.get(b.name)
            # capture.lazy: a bucket one worker never set up (and ran nothing in) is reported
            # as a worker that set it up saw it
            if have is None or (have.status == "unused" and b.status != "unused"):
                merged[b.name] = b.model_copy(deep=True)
                continue
            have.batches += b.batches
            have.records += b.records
            have.padded_rows += b.padded_rows
            for axis, n in b.padded_positions.items():
                have.padded_positions[axis] = have.padded_positions.get(axis, 0) + n
            for key in ("warmup_s", "capture_s", "memory_bytes"):
                if getattr(b, key) is not None:
                    setattr(have, key, max(getattr(have, key) or 0, getattr(b, key)))
        for line in last_lines(worker_dir(top, rank) / "latencies.jsonl", m.totals.batches):
            phases = samples.setdefault(line.get("bucket"), {})
            for key, us in line.items():
                if key.endswith("_us"):
                    phases.setdefault(key[:-3], []).append(us)
    for name, b in merged.items():
        b.latency_us = {ph: percentiles(v, ps) for ph, v in samples.get(name, {}).items()}
    return list(merged.values())


def last_lines(path: Path, n: int) -> list[dict]:
    if n <= 0 or not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()[-n:]
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def totals(reports: list[WorkerReport], manifests: list, buckets: list, t0: float
           ) -> Totals:
    """The workers' added up. manifests: this attempt's (None for a worker that died, or was
    complete before): such a worker's records count as earlier, its stream is not known."""
    done = [m for m in manifests if m is not None]

    def most(key):
        return max((getattr(m.totals, key) for m in done), default=0)

    out = sum(r.records_out for r in reports)
    earlier = sum(m.totals.earlier_records_out if m else r.records_out
                  for r, m in zip(reports, manifests))
    earlier_rejected = sum(m.totals.earlier_records_rejected if m else r.records_rejected
                           for r, m in zip(reports, manifests))
    stream = max((r.stream_s for r in reports), default=0.0)
    busy = [m.totals.device_busy_fraction for m in done
            if m.totals.device_busy_fraction is not None]
    host: dict[str, float] = {}  # a worker's mean: its shares are of one worker's stream
    for m in done:
        for k, v in m.totals.host_phase_s.items():
            host[k] = host.get(k, 0.0) + v / len(done)
    mean_busy = sum(busy) / len(busy) if busy else None
    return Totals(
        records_in=sum(r.records_in for r in reports), records_out=out,
        records_rejected=sum(r.records_rejected for r in reports),
        earlier_records_out=earlier,
        earlier_records_rejected=earlier_rejected,
        batches=sum(r.batches for r in reports), wall_s=time.perf_counter() - t0,
        setup_s=most("setup_s"), stream_s=stream, input_hash_s=most("input_hash_s"),
        records_per_s=(out - earlier) / stream if stream else 0.0,
        capture_s=most("capture_s"), capture_memory_bytes=most("capture_memory_bytes"),
        padding_ratio=padding_ratio(buckets),
        padding_ratio_positions=position_ratios(buckets), device_busy_fraction=mean_busy,
        device_idle_fraction=None if mean_busy is None else 1.0 - mean_busy,
        overlapped=done[0].totals.overlapped if done else None,
        overlap_reason=done[0].totals.overlap_reason if done else None, host_phase_s=host,
        texts_truncated=_sum_known([m.totals.texts_truncated for m in done]),
        text_max_tokens=done[0].totals.text_max_tokens if done else None)


def _sum_known(values: list) -> int | None:
    """The workers' counts added up; None where no worker counted (not a data.text job)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None
