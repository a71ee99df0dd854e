"""`graphrun bench SPEC`: every bucket timed in every mode, on synthetic inputs of the bucket's
full shape (the spec's dtypes and ranges), no output shards.

Modes: eager (graphrun with capture.backend: eager), graph (the spec's backend: CUDA graph
replay on a GPU), and with --compile graphrun's `model.compile: true` and torch.compile's
reduce-overhead mode (GPU only). Each step is end to end and synchronous: host arrays in, the
copy to the device, the step, the copy back; timed by the host clock around it (the step
returns only once the outputs are on the host). Every mode is set up first (all at once), then
timed `repeats` times, alternating (per repeat and bucket: eager, graph, ... in turn, so drift
of the machine hits every mode alike). Per repeat, bucket and mode: a warm-up of `warmup`
steps, then `iters` steps over `distinct` different input batches in turn. Percentiles are over
all the timed steps; each repeat's p50 gives the median and range (stats.Spread) that decide
whether one mode beats another beyond the noise (stats.RULE), and the speedup over eager.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from graphrun.base.units import MiB
from graphrun.base.errors import GraphrunError, first_line
from graphrun.engine.capture import setup_failed
from graphrun.engine.probe import bucket_costs, synthetic_batch
from graphrun.experiments.stats import Spread, Verdict, range_text, separated, spread, verdict
from graphrun.spec.keys import BATCH, FLOAT_DTYPES, PipelineSpec

SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "bench.schema.json"
PERCENTILES = (50, 90, 99)


class _B(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModeResult(_B):
    mode: str = Field(..., description="eager | graph | compile | reduce-overhead")
    backend: str = Field(..., description="What ran: cuda-graph, eager, torch.compile ...")
    latency_us: dict[str, float] = Field(..., description="p50/p90/p99 of all the timed "
                                         "steps (every repeat), us.")
    p50_spread_us: Optional[Spread] = Field(None, description="Each repeat's p50, us: their "
                                            "median and range.")
    speedup: Optional[float] = Field(None, description="Eager's median p50 / this mode's "
                                     "(the medians of the repeats' p50s).")
    speedup_beyond_noise: Optional[bool] = Field(
        None, description="Whether this mode and eager differ beyond the noise (stats rule); "
        "null for eager itself.")
    capture_s: Optional[float] = Field(None, description="Capture time (graph modes); the "
                                       "first call for reduce-overhead (compilation).")
    memory_bytes: Optional[int] = None
    verify: Optional[bool] = Field(None, description="graphrun's replay == eager check.")
    # a generation spec's rows (bench_generate.py): latency_us is then a whole generate call
    output_tokens_per_s: Optional[float] = Field(
        None, description="Generation: new tokens of the timed calls / their wall time.")
    output_tokens_per_s_spread: Optional[Spread] = Field(
        None, description="Generation: each repeat's output tokens/s.")
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
    fastest: Optional[Verdict] = Field(None, description="The fastest mode by the repeats' "
                                       "p50, named only beyond the noise; null with one mode.")


class Bench(_B):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"title": "graphrun bench"})

    spec: str
    device: str
    iters: int = Field(..., description="Timed steps (calls) per repeat, bucket and mode.")
    warmup: int = Field(..., description="Untimed ones before each repeat's.")
    repeats: int = Field(1, description="Timings per bucket and mode, alternating the modes.")
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


@dataclass
class Session:
    """One mode, set up: a step per bucket (key), what each bucket's set-up cost, and its
    backend."""

    mode: str
    steps: dict[Any, Callable] = field(default_factory=dict)
    costs: dict[Any, dict] = field(default_factory=dict)  # capture_s, memory_bytes, verify
    backend: dict[Any, str] = field(default_factory=dict)


def open_graphrun(stack: contextlib.ExitStack, spec: PipelineSpec, mode: str, batches: dict
                  ) -> Session:
    """One graphrun Runner for the whole spec, every bucket set up (and dropped, over a memory
    budget) before any is timed."""
    from graphrun.engine.runner import Runner

    runner = stack.enter_context(Runner(_with(spec, "capture", lazy=False)))
    session = Session(mode)
    for name, c in bucket_costs(runner).items():
        if name not in batches or c.get("status") == "skipped":
            continue
        session.steps[name] = runner.run_batch
        session.costs[name] = {k: c.get(k) for k in ("capture_s", "memory_bytes", "verify")}
        session.backend[name] = ("cuda-graph" if c.get("status") == "captured" else "eager") + (
            " + torch.compile" if spec.model.compile else "")
    return session


def open_reduce_overhead(spec: PipelineSpec, batches: dict) -> Session:
    """torch.compile(mode="reduce-overhead") of the bare model, fed and read back as graphrun's
    steps are (host arrays in, host arrays out); the first call per bucket compiles (its
    capture_s)."""
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

    session = Session("reduce-overhead")
    for name, bucket_batches in batches.items():
        t0 = time.perf_counter()
        step(bucket_batches[0])
        session.steps[name] = step
        session.costs[name] = {"capture_s": time.perf_counter() - t0}
        session.backend[name] = "torch.compile reduce-overhead"
    return session


def _with(spec: PipelineSpec, section: str, **values) -> PipelineSpec:
    return spec.model_copy(update={section: getattr(spec, section).model_copy(update=values)})


def open_sessions(openers: list, notes: list[str], log) -> list[Session]:
    """Each mode's session, in order. One mode failing to set up is a finding (a note, no
    results), not the end of the bench; eager, the baseline, failing is."""
    sessions = []
    for mode, opener in openers:
        log(f"bench: setting up {mode} ...")
        try:
            sessions.append(opener())
        except Exception as err:  # noqa: BLE001 - see the docstring
            if mode == "eager":
                raise
            notes.append(f"{mode} failed: {first_line(err)}")
    return sessions


def round_robin(sessions: list[Session], keys: list, repeats: int, measure, notes: list[str],
                log, every_s: float = 10.0) -> dict[str, dict[Any, list]]:
    """mode -> key -> each repeat's measure(session, key), alternating: per repeat and key,
    every mode in turn. A mode failing while timed is dropped with a note (eager raises).
    Where a repeat takes long (a generation bench on a CPU), a line every `every_s` says how
    far it is."""
    got: dict[str, dict[Any, list]] = {s.mode: {k: [] for k in keys if k in s.steps}
                                       for s in sessions}
    alive = list(sessions)
    t0 = said = time.monotonic()
    for r in range(repeats):
        log(f"bench: repeat {r + 1}/{repeats} ({', '.join(s.mode for s in alive)} in turn)")
        for i, key in enumerate(keys):
            if time.monotonic() - said >= every_s:
                said = time.monotonic()
                # counted across repeats: a later repeat's start is no "0 of N"
                log(f"bench: {r * len(keys) + i} of {repeats * len(keys)} bucket timings done "
                    f"(repeat {r + 1}/{repeats}), {said - t0:,.0f} s so far")
            for s in list(alive):
                if key not in s.steps:
                    continue
                try:
                    got[s.mode][key].append(measure(s, key))
                except GraphrunError:
                    raise
                except Exception as err:  # noqa: BLE001 - as open_sessions
                    if s.mode == "eager":  # the model itself fails on this bucket's shape
                        raise setup_failed(err, str(key)) from err
                    notes.append(f"{s.mode} failed: {first_line(err)}")
                    alive.remove(s)
                    got[s.mode] = {}
    return got


def judge(modes: list[ModeResult]) -> Optional[Verdict]:
    """Speedups over eager marked beyond the noise or not, and the fastest mode (by the
    repeats' p50) named only beyond the noise."""
    eager = next((m for m in modes if m.mode == "eager"), None)
    for m in modes:
        if eager is not None and eager.p50_spread_us and m.p50_spread_us:
            m.speedup = eager.p50_spread_us.median / m.p50_spread_us.median
            if m is not eager:
                m.speedup_beyond_noise = (
                    separated(m.p50_spread_us, eager.p50_spread_us, higher=False)
                    or separated(eager.p50_spread_us, m.p50_spread_us, higher=False))
    timed = {m.mode: m.p50_spread_us for m in modes if m.p50_spread_us}
    return verdict(timed, "p50 us", higher=False, fmt=",.0f") if len(timed) > 1 else None


def default_repeats(device) -> int:
    """3 on a CUDA device (a range, and enough to name a winner); 2 on a CPU (a range, fast)."""
    return 3 if device.type == "cuda" else 2


def bench(spec: PipelineSpec, *, iters: int = 50, warmup: int = 5, distinct: int = 4,
          compile: bool = False, records: int | None = None, repeats: int | None = None,
          log=print, open_graphrun: Callable = open_graphrun,
          time_steps: Callable = time_steps) -> Bench:
    """Every bucket timed in every mode (the module's docstring). open_graphrun opens a mode's
    session, time_steps times one bucket's steps: a caller (a test) may hand in its own."""
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
    repeats = repeats or default_repeats(device)
    cuda, notes = device.type == "cuda", []
    openers = [("eager", lambda: open_graphrun(stack, _with(spec, "capture", backend="eager"),
                                               "eager", batches))]
    if cuda:
        openers.append(("graph", lambda: open_graphrun(stack, spec, "graph", batches)))
    else:
        notes.append("no CUDA device: the eager backend only, graph replay not measured")
    if compile:
        openers.append(("compile", lambda: open_graphrun(
            stack, _with(spec, "model", compile=True), "compile", batches)))
        if cuda:
            openers.append(("reduce-overhead", lambda: open_reduce_overhead(spec, batches)))
        else:
            notes.append("no CUDA device: torch.compile reduce-overhead not measured")
    names = [_name(s) for s in bucket_sizes(spec)]
    with contextlib.ExitStack() as stack:
        sessions = open_sessions(openers, notes, log)
        times = round_robin(sessions, names, repeats,
                            lambda s, name: time_steps(s.steps[name], batches[name], iters,
                                                       warmup), notes, log)
    out = []
    for sizes in bucket_sizes(spec):
        name = _name(sizes)
        ran = []
        for s in sessions:
            per_repeat = times[s.mode].get(name)
            if not per_repeat:
                continue
            steps = np.concatenate(per_repeat)
            cost = s.costs[name]
            ran.append(ModeResult(
                mode=s.mode, backend=s.backend[name],
                latency_us={f"p{p}": float(np.percentile(steps, p)) for p in PERCENTILES},
                p50_spread_us=spread([float(np.percentile(t, 50)) for t in per_repeat]),
                capture_s=cost.get("capture_s"), memory_bytes=cost.get("memory_bytes"),
                verify=cost.get("verify")))
        out.append(BucketBench(name=name, sizes=sizes, modes=ran, fastest=judge(ran)))
    return Bench(spec=str(spec.source_path or spec.name), device=str(device), iters=iters,
                 warmup=warmup, repeats=repeats, distinct=distinct, inputs=inputs, notes=notes,
                 buckets=out)


def speedup_text(m: ModeResult) -> str:
    if m.speedup is None:
        return "-"
    return f"{m.speedup:.2f}x" + ("" if m.speedup_beyond_noise in (None, True) else " ~")


def title_of(result: Bench, what: str, sets: str) -> str:
    return (f"bench of {result.spec} on {result.device}: {result.repeats} repeat"
            f"{'s' if result.repeats > 1 else ''} (modes alternated) of {result.iters} {what} "
            f"per bucket and mode over {result.distinct} {sets} ({result.inputs}), each after "
            f"{result.warmup} warm-up ones; p50: the repeats' median and range; p90, p99: of all "
            "steps; ~ = within the noise of eager")


def verdict_lines(result: Bench) -> list[str]:
    """Per bucket with more than one mode: the fastest, or "no significant difference"."""
    return [f"{b.name}: {b.fastest.text}" for b in result.buckets if b.fastest is not None]


def bench_table(result: Bench):
    from rich.table import Table

    table = Table(title=title_of(result, "steps", "input batches"))
    for col in ("bucket", "mode", "backend", "p50 us", "p50 range", "p90 us", "p99 us",
                "speedup", "capture s", "MiB", "verify"):
        table.add_column(col, justify="left" if col in ("bucket", "mode", "backend")
                         else "right")
    for b in result.buckets:
        for i, m in enumerate(b.modes):
            lat = m.latency_us
            p50 = m.p50_spread_us.median if m.p50_spread_us else lat["p50"]
            table.add_row(b.name if i == 0 else "", m.mode, m.backend, f"{p50:,.0f}",
                          range_text(m.p50_spread_us, ",.0f"),
                          f"{lat['p90']:,.0f}", f"{lat['p99']:,.0f}", speedup_text(m),
                          "-" if m.capture_s is None else f"{m.capture_s:.3f}",
                          "-" if m.memory_bytes is None else f"{m.memory_bytes / MiB:,.1f}",
                          {True: "passed", False: "FAILED", None: "-"}[m.verify])
    return table
