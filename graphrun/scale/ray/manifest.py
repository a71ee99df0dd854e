"""The manifest of a --ray run: buckets and totals summed over the actors' statistics (the
Collector's), the output files read back, and Ray's own report (RayReport)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from graphrun.base.digest import file_sha256
from graphrun.base.phases import utc_now
from graphrun.engine.padding import padding_ratio
from graphrun.manifest.latency import percentiles
from graphrun.manifest.keys import (BucketReport, Environment, FileEntry, Manifest, Totals,
                                    environment, run_manifest)
from graphrun.manifest.sections import RayActor, RayReport
from graphrun.spec.keys import PipelineSpec


@dataclass
class RunFacts:
    """What the run gathers on the way to its manifest."""

    spec: PipelineSpec
    spec_json: dict
    out_dir: Path
    bucket_plan: object
    address: str | None
    t0: float = field(default_factory=time.perf_counter)
    started: str = field(default_factory=utc_now)
    status: str = "failed"
    error: str | None = None
    workers: int = 0
    collector: object = None
    stream_t0: float | None = None
    stream_s: float = 0.0
    dataset_stats: str = ""
    files: list[Path] = field(default_factory=list)
    rejects: int = 0


def ray_manifest(f: RunFacts) -> Manifest:
    import ray

    stats = f.collector.stats() if f.collector else {"actors": {}, "samples": {}}
    actors = stats["actors"]
    buckets = merged_buckets(actors, stats["samples"], f.spec.report.percentiles)
    files = [file_entry(p, f.spec.output.format) for p in f.files]
    out = sum(e.rows for e in files)
    warnings = [w for a in actors.values() for w in a["warnings"]]
    counted = sum(a["records"] for a in actors.values())
    if f.status == "completed" and counted != out:
        warnings.append(f"the actors ran {counted} records but the files hold {out}")
    if f.stream_t0 is not None and not f.stream_s:
        f.stream_s = time.perf_counter() - f.stream_t0
    totals = Totals(
        records_in=out + f.rejects, records_out=out, records_rejected=f.rejects,
        batches=sum(b.batches for b in buckets), wall_s=time.perf_counter() - f.t0,
        setup_s=max((a["setup_s"] for a in actors.values()), default=0.0),
        stream_s=f.stream_s, records_per_s=out / f.stream_s if f.stream_s else 0.0,
        capture_s=sum(b.capture_s or 0.0 for b in buckets),
        capture_memory_bytes=sum(b.memory_bytes or 0 for b in buckets),
        padding_ratio=padding_ratio(buckets))
    report = RayReport(
        ray_version=ray.__version__, address=f.address, workers=f.workers,
        nodes=sum(1 for n in ray.nodes() if n.get("Alive")) if ray.is_initialized() else 0,
        actors=[ray_actor(a) for a in actors.values()], dataset_stats=f.dataset_stats)
    return run_manifest(
        f.spec, spec_json=f.spec_json, input_sha256=None, rejected=f.rejects,
        rejects_path="rejects.jsonl" if f.rejects else None,
        status=f.status, error=f.error, started_at=f.started,
        environment=actor_environment(actors), buckets=buckets, totals=totals, files=files,
        bucket_plan=f.bucket_plan, warnings=warnings, ray=report)


def merged_buckets(actors: dict, samples: dict, ps: list) -> list[BucketReport]:
    """Each bucket's report summed over the actors (counts, capture time and memory), its
    latency percentiles over every actor's batches; status, verify and lanes of the first
    actor that reported it."""
    merged: dict[str, BucketReport] = {}
    for a in actors.values():
        for b in a["buckets"]:
            r = BucketReport(**b)
            have = merged.get(r.name)
            if have is None:
                merged[r.name] = r
                continue
            for key in ("batches", "records", "padded_rows"):
                setattr(have, key, getattr(have, key) + getattr(r, key))
            for key in ("capture_s", "warmup_s", "memory_bytes"):
                if getattr(r, key) is not None:
                    setattr(have, key, (getattr(have, key) or 0) + getattr(r, key))
            for axis, v in r.padded_positions.items():
                have.padded_positions[axis] = have.padded_positions.get(axis, 0) + v
    for name, report in merged.items():
        report.latency_us = {ph: percentiles(v, ps) for ph, v in samples.get(name, {}).items()}
    return list(merged.values())


def ray_actor(a: dict) -> RayActor:
    capture = sum(b.get("capture_s") or 0.0 for b in a["buckets"])
    return RayActor(host=a["host"], pid=a["pid"], device=a["device"], backend=a["backend"],
                    setup_s=a["setup_s"], capture_s=capture, batches=a["batches"],
                    records=a["records"], rejected=a["rejected"], busy_s=a["busy_s"],
                    warnings=a["warnings"])


def actor_environment(actors: dict) -> Environment | None:
    """The driver's environment, with the device and backend the actors ran on."""
    import torch

    if not actors:
        return None
    first = next(iter(actors.values()))
    env = environment(torch.device("cpu"), first["backend"])
    return env.model_copy(update={"device": first["device"]})


def file_entry(path: Path, fmt: str) -> FileEntry:
    digest = file_sha256(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(path).metadata.num_rows
    else:
        with open(path, "rb") as fh:
            rows = sum(1 for line in fh if line.strip())
    return FileEntry(path=path.name, rows=rows, sha256=digest.hexdigest(),
                     bytes=path.stat().st_size)

