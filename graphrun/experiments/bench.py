"""`graphrun bench SPEC`: every bucket timed in every mode, on synthetic inputs of the bucket's
full shape (the spec's dtypes and ranges), no output shards.

Modes: eager (graphrun with capture.backend: eager), graph (the spec's backend: CUDA graph
replay on a GPU), and with --compile graphrun's `model.compile: true` and torch.compile's
reduce-overhead mode (GPU only). Each step is end to end and synchronous: host arrays in, the
copy to the device, the step, the copy back; timed by the host clock around it (the step
returns only once the outputs are on the host). Per bucket: a warm-up of `warmup` steps, then
`iters` steps over `distinct` different input batches in turn; percentiles and the speedup
over eager of the medians.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from graphrun.engine.probe import bucket_costs, synthetic_batch
from graphrun.spec.keys import BATCH, FLOAT_DTYPES, PipelineSpec

SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "bench.schema.json"
PERCENTILES = (50, 90, 99)


class _B(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModeResult(_B):
    mode: str = Field(..., description="eager | graph | compile | reduce-overhead")
    backend: str = Field(..., description="What ran: cuda-graph, eager, torch.compile ...")
    latency_us: dict[str, float] = Field(..., description="p50/p90/p99 of the steps, us.")
    speedup: Optional[float] = Field(None, description="Eager p50 / this mode's p50.")
    capture_s: Optional[float] = Field(None, description="Capture time (graph modes); the "
                                       "first call for reduce-overhead (compilation).")
    memory_bytes: Optional[int] = None
    verify: Optional[bool] = Field(None, description="graphrun's replay == eager check.")
    # a generation spec's rows (bench_generate.py): latency_us is then a whole generate call
    output_tokens_per_s: Optional[float] = Field(
        None, description="Generation: new tokens of the timed calls / their wall time.")
    ttft_ms: Optional[dict[str, float]] = Field(
        None, description="Generation: time to first token per call (prefill and the first "
        "pick), p50/p90/p99, ms.")
    tpot_ms: Optional[dict[str, float]] = Field(
        None, description="Generation: time per output token after the first (a call's decode "
        "time / its decode steps), p50/p90/p99, ms.")


class BucketBench(_B):
    name: str
    sizes: dict[str, int]
    modes: list[ModeResult]


class Bench(_B):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"title": "graphrun bench"})

    spec: str
    device: str
    iters: int
    warmup: int
    distinct: int = Field(..., description="Different input batches per bucket, in turn.")
    inputs: str = Field(..., description="synthetic (seeded, the spec's dtypes and ranges), or "
                        "the first N real records, cut or padded to each bucket's shape.")
    notes: list[str] = Field(default_factory=list)
    buckets: list[BucketBench]
    new_tokens: Optional[int] = Field(None, description="Generation: the new tokens every "
                                      "row made per call (--new-tokens, else "
                                      "generate.max_new_tokens).")


def schema_text() -> str:
    import json

    return json.dumps(Bench.model_json_schema(), indent=2) + "\n"


def bucket_sizes(spec: PipelineSpec) -> list[dict[str, int]]:
    axes = spec.axes
    return [dict(zip(axes, combo)) for combo in
            itertools.product(*(spec.buckets[a] for a in axes))]


def real_records(spec: PipelineSpec, n: int) -> dict[str, list[np.ndarray]]:
    """The first n valid records of the input, per input a list of per-record arrays."""
    from graphrun.plan.planner import read_batches_for_plan, reading_spec

    records: dict[str, list[np.ndarray]] = {name: [] for name in spec.inputs}
    for batch in read_batches_for_plan(reading_spec(spec), stop=n):
        for name in spec.inputs:
            records[name].extend(np.asarray(r) for r in batch.fields[name])
    return records


def real_batch(spec: PipelineSpec, records: dict, sizes: dict[str, int], first: int) -> dict:
    """A batch of the bucket's full shape from records first, first+1, ... (cycling), each cut
    or padded (with the input's pad value) to the bucket."""
    count = len(next(iter(records.values())))
    rows = [(first + i) % count for i in range(sizes[BATCH])]
    out = {}
    for name, inp in spec.inputs.items():
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in inp.shape)
        dtype = np.float32 if inp.dtype in FLOAT_DTYPES else np.dtype(inp.dtype)
        a = np.full(shape, inp.pad, dtype=dtype)
        for r, i in enumerate(rows):
            rec = records[name][i]
            cut = tuple(slice(0, min(x, y)) for x, y in zip(rec.shape, shape[1:]))
            a[(r,) + cut] = rec[cut]
        out[name] = a
    return out


def time_steps(step, batches: list, iters: int, warmup: int) -> np.ndarray:
    """[iters] us per synchronous step, over the batches in turn, after `warmup` steps."""
    for i in range(warmup):
        step(batches[i % len(batches)])
    times = np.empty(iters)
    for i in range(iters):
        batch = batches[i % len(batches)]
        t0 = time.perf_counter()
        step(batch)
        times[i] = (time.perf_counter() - t0) * 1e6
    return times


def _name(sizes: dict[str, int]) -> str:
    return ",".join(f"{a}={s}" for a, s in sizes.items())


def bench_graphrun(spec: PipelineSpec, mode: str, batches: dict, iters: int, warmup: int
                   ) -> dict[str, ModeResult]:
    """One graphrun Runner for the whole spec; each bucket timed through run_batch, every
    bucket set up (and dropped, over a memory budget) before any is timed."""
    import graphrun

    with graphrun.Runner(_with(spec, "capture", lazy=False)) as runner:
        costs = bucket_costs(runner)
        results = {}
        for name, bucket_batches in batches.items():
            c = costs.get(name, {})
            if c.get("status") == "skipped":
                continue
            times = time_steps(runner.run_batch, bucket_batches, iters, warmup)
            backend = "cuda-graph" if c.get("status") == "captured" else "eager"
            results[name] = ModeResult(
                mode=mode, backend=backend + (" + torch.compile" if spec.model.compile else ""),
                latency_us={f"p{p}": float(np.percentile(times, p)) for p in PERCENTILES},
                capture_s=c.get("capture_s"), memory_bytes=c.get("memory_bytes"),
                verify=c.get("verify"))
    return results


def bench_reduce_overhead(spec: PipelineSpec, batches: dict, iters: int, warmup: int
                          ) -> dict[str, ModeResult]:
    """torch.compile(mode="reduce-overhead") of the bare model, fed and read back as graphrun's
    steps are (host arrays in, host arrays out); the first call per bucket compiles."""
    import torch

    from graphrun.engine.device import resolve_device
    from graphrun.models.call import call_model
    from graphrun.base.dtypes import torch_dtype
    from graphrun.models.load import build_model

    device = resolve_device(spec.device)
    dtype = torch_dtype(spec.model.dtype)
    with torch.inference_mode():
        model = build_model(spec, device, spec.base_dir)
    torch._dynamo.config.cache_size_limit = max(64, 2 * len(batches))  # a graph per bucket
    fn = torch.compile(model, mode="reduce-overhead")

    def step(batch: dict) -> None:
        with torch.inference_mode():
            ins = {k: torch.from_numpy(v).to(device) for k, v in batch.items()}
            ins = {k: t.to(dtype) if t.is_floating_point() else t for k, t in ins.items()}
            ret = call_model(fn, ins, spec.model.call)
            for t in (ret.values() if isinstance(ret, dict) else
                      ret if isinstance(ret, (tuple, list)) else [ret]):
                t.cpu()

    results = {}
    for name, bucket_batches in batches.items():
        t0 = time.perf_counter()
        step(bucket_batches[0])
        first_s = time.perf_counter() - t0
        times = time_steps(step, bucket_batches, iters, warmup)
        results[name] = ModeResult(
            mode="reduce-overhead", backend="torch.compile reduce-overhead",
            latency_us={f"p{p}": float(np.percentile(times, p)) for p in PERCENTILES},
            capture_s=first_s)
    return results


def _with(spec: PipelineSpec, section: str, **values) -> PipelineSpec:
    return spec.model_copy(update={section: getattr(spec, section).model_copy(update=values)})


def run_modes(modes: list, notes: list[str], log) -> dict:
    """mode -> its results, each mode's run() in order. One mode failing is a finding (a note,
    no results), not the end of the bench; eager, the baseline, failing is."""
    by_mode = {}
    for mode, run in modes:
        log(f"bench: {mode} ...")
        try:
            by_mode[mode] = run()
        except Exception as err:  # noqa: BLE001 - see the docstring
            if mode == "eager":
                raise
            by_mode[mode] = {}
            notes.append(f"{mode} failed: {type(err).__name__}: {str(err).splitlines()[0]}")
    return by_mode


def bench(spec: PipelineSpec, *, iters: int = 50, warmup: int = 5, distinct: int = 4,
          compile: bool = False, records: int | None = None, log=print) -> Bench:
    from graphrun.engine.device import resolve_device
    from graphrun.base.errors import InputError

    if records is None:
        inputs = "synthetic"
        batches = {_name(s): [synthetic_batch(spec, s, seed) for seed in range(distinct)]
                   for s in bucket_sizes(spec)}
    else:
        real = real_records(spec, records)
        if not next(iter(real.values())):
            raise InputError(f"no valid record among the first {records}",
                             where=str(spec.data.path))
        inputs = f"the first {len(next(iter(real.values())))} real records"
        batches = {_name(s): [real_batch(spec, real, s, k * s[BATCH]) for k in range(distinct)]
                   for s in bucket_sizes(spec)}
    device = resolve_device(spec.device)
    cuda, notes = device.type == "cuda", []
    modes = [("eager", lambda: bench_graphrun(_with(spec, "capture", backend="eager"), "eager",
                                              batches, iters, warmup))]
    if cuda:
        modes.append(("graph", lambda: bench_graphrun(spec, "graph", batches, iters, warmup)))
    else:
        notes.append("no CUDA device: the eager backend only, graph replay not measured")
    if compile:
        modes.append(("compile", lambda: bench_graphrun(_with(spec, "model", compile=True),
                                                        "compile", batches, iters, warmup)))
        if cuda:
            modes.append(("reduce-overhead",
                          lambda: bench_reduce_overhead(spec, batches, iters, warmup)))
        else:
            notes.append("no CUDA device: torch.compile reduce-overhead not measured")
    by_mode = run_modes(modes, notes, log)
    out = []
    for sizes in bucket_sizes(spec):
        name = _name(sizes)
        ran = [by_mode[m][name] for m, _ in modes if name in by_mode[m]]
        eager = by_mode["eager"].get(name)
        for r in ran:  # the eager run of the same bucket is the baseline
            if eager is not None:
                r.speedup = eager.latency_us["p50"] / r.latency_us["p50"]
        out.append(BucketBench(name=name, sizes=sizes, modes=ran))
    return Bench(spec=str(spec.source_path or spec.name), device=str(device), iters=iters,
                 warmup=warmup, distinct=distinct, inputs=inputs, notes=notes, buckets=out)


def bench_table(result: Bench):
    from rich.table import Table

    table = Table(title=f"bench of {result.spec} on {result.device}: {result.iters} steps per "
                  f"bucket and mode over {result.distinct} input batches ({result.inputs}), "
                  f"after {result.warmup} warm-up steps")
    for col in ("bucket", "mode", "backend", "p50 us", "p90 us", "p99 us", "speedup",
                "capture s", "MiB", "verify"):
        table.add_column(col, justify="left" if col in ("bucket", "mode", "backend")
                         else "right")
    for b in result.buckets:
        for i, m in enumerate(b.modes):
            lat = m.latency_us
            table.add_row(b.name if i == 0 else "", m.mode, m.backend, f"{lat['p50']:,.0f}",
                          f"{lat['p90']:,.0f}", f"{lat['p99']:,.0f}",
                          "-" if m.speedup is None else f"{m.speedup:.2f}x",
                          "-" if m.capture_s is None else f"{m.capture_s:.3f}",
                          "-" if m.memory_bytes is None else f"{m.memory_bytes / 2**20:,.1f}",
                          {True: "passed", False: "FAILED", None: "-"}[m.verify])
    return table
