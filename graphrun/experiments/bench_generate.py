"""`graphrun bench SPEC` for a generation spec: per (batch bucket, prompt bucket), prefill and
decode timed through the Generator on the model as a generation job builds it, no output
shards.

Each bucket's prompts are synthetic (seeded token ids, every prompt the bucket's full length)
and every row makes exactly `new_tokens` tokens (min_new_tokens = max_new_tokens, so a stop id
never ends a batch early and every iteration does the same work). Per bucket: one call that sets
up its graphs (their capture time is the row's capture_s), `warmup` untimed calls, then `iters`
timed ones over `distinct` prompt sets in turn. Modes: eager (the eager backend), and on a GPU
graph (capture.backend: prefill and decode steps replayed).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np

from graphrun.base.errors import SpecError, Problem
from graphrun.experiments.bench import PERCENTILES, Bench, BucketBench, ModeResult, run_modes
from graphrun.spec.generate import PROMPT_AXIS
from graphrun.spec.keys import BATCH, PipelineSpec


def refuse(option: str, why: str) -> SpecError:
    return SpecError([Problem(f"graphrun bench {option}", "", why)])


def bench_generation(spec: PipelineSpec, *, iters: int = 20, warmup: int = 2,
                     distinct: int = 2, new_tokens: int | None = None, log=print) -> Bench:
    """The Bench of a generation spec (spec.generate set): one row per bucket and mode."""
    from graphrun.engine.device import resolve_backend, resolve_device
    from graphrun.generate.runner import build_generation_model, generate_config

    new = new_tokens or spec.generate.max_new_tokens
    device = resolve_device(spec.device)
    cuda = device.type == "cuda"
    model = build_generation_model(spec, device)
    config = dataclasses.replace(generate_config(spec, model), max_new_tokens=new,
                                 min_new_tokens=new)
    modes = [("eager", "eager")]
    notes = [f"every row makes {new} new tokens (min_new_tokens = max_new_tokens = {new})"]
    if cuda:
        modes.append(("graph", resolve_backend(spec.capture.backend, device)))
    else:
        notes.append("no CUDA device: the eager backend only, graph replay not measured")
    sizes = [(b, p) for b in sorted(spec.buckets[BATCH]) for p in sorted(spec.buckets[PROMPT_AXIS])]
    by_mode = run_modes(
        [(mode, functools.partial(_bench_mode, spec, model, config, device, mode, backend,
                                  sizes, iters, warmup, distinct)) for mode, backend in modes],
        notes, log)
    rows = []
    for b, p in sizes:
        name = f"{BATCH}={b},{PROMPT_AXIS}={p}"
        ran = [by_mode[m][(b, p)] for m, _ in modes if (b, p) in by_mode[m]]
        eager = by_mode["eager"].get((b, p))
        for r in ran:  # the eager run of the same bucket is the baseline
            if eager is not None:
                r.speedup = eager.latency_us["p50"] / r.latency_us["p50"]
        rows.append(BucketBench(name=name, sizes={BATCH: b, PROMPT_AXIS: p}, modes=ran))
    return Bench(spec=str(spec.source_path or spec.name), device=str(device), iters=iters,
                 warmup=warmup, distinct=distinct,
                 inputs=f"synthetic prompts (seeded token ids) of each prompt bucket's length, "
                 f"{new} new tokens a row", notes=notes, buckets=rows, new_tokens=new)


def _bench_mode(spec, model, config, device, mode: str, backend: str, sizes: list,
                iters: int, warmup: int, distinct: int) -> dict:
    """(batch, prompt) -> ModeResult, through one Generator over all the buckets."""
    from graphrun.generate.generator import Generator

    gen = Generator(model, config=config, batch_buckets=sorted(spec.buckets[BATCH]),
                    prompt_buckets=sorted(spec.buckets[PROMPT_AXIS]), device=device,
                    dtype=spec.model.dtype, backend=backend,
                    verify=spec.capture.verify.enabled, lazy=True,
                    memory_budget_mib=spec.capture.memory_budget_mib)
    try:
        vocab = gen.model.vocab
        out = {}
        for b, p in sizes:
            sets = [synthetic_prompts(b, p, vocab, seed) for seed in range(distinct)]
            ids = list(range(b))
            before = {_key(g) for g in gen.buckets()}
            gen.generate(sets[0], ids)  # sets up the graphs this bucket is the first to need
            new = [g for g in gen.buckets() if _key(g) not in before]
            for i in range(warmup):
                gen.generate(sets[i % distinct], ids)
            walls, ttft, tpot, tokens = [], [], [], 0
            for i in range(iters):
                t0 = time.perf_counter()
                r = gen.generate(sets[i % distinct], ids)
                walls.append(time.perf_counter() - t0)
                ttft.append(r.ttft_s)
                if r.decode_steps:
                    tpot.append(r.decode_s / r.decode_steps)
                tokens += sum(c.output_tokens for c in r.completions)
            checks = [g["verify"].get("passed") for g in new if g["verify"]]
            out[(b, p)] = ModeResult(
                mode=mode, backend=backend, latency_us=_pcts(walls, 1e6),
                output_tokens_per_s=tokens / sum(walls), ttft_ms=_pcts(ttft, 1e3),
                tpot_ms=_pcts(tpot, 1e3) if tpot else None,
                capture_s=(sum(g["capture_s"] or 0.0 for g in new)
                           if backend == "cuda-graph" else None),
                memory_bytes=(sum(g["memory_bytes"] or 0 for g in new)
                              if backend == "cuda-graph" else None),
                verify=all(checks) if checks else None)
        return out
    finally:
        gen.close()


def synthetic_prompts(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """rows prompts of `length` seeded token ids in [1, vocab)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, size=(rows, length)).tolist()


def _key(g: dict) -> tuple:
    return g["kind"], g["shape"]["rows"], g["shape"].get("prompt", g["shape"].get("kv"))


def _pcts(values: list[float], scale: float) -> dict[str, float]:
    return {f"p{p}": float(np.percentile(values, p)) * scale for p in PERCENTILES}


def generation_table(result: Bench):
    from rich.table import Table

    table = Table(title=f"bench of {result.spec} on {result.device}: {result.iters} generate "
                  f"calls per bucket and mode over {result.distinct} prompt sets ("
                  f"{result.inputs}), after {result.warmup} warm-up calls")
    for col in ("bucket", "mode", "backend", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
                "TPOT p50 ms", "TPOT p99 ms", "call p50 ms", "speedup", "capture s", "verify"):
        table.add_column(col, justify="left" if col in ("bucket", "mode", "backend")
                         else "right")
    for b in result.buckets:
        for i, m in enumerate(b.modes):
            tpot = m.tpot_ms or {}
            table.add_row(b.name if i == 0 else "", m.mode, m.backend,
                          f"{m.output_tokens_per_s:,.0f}", f"{m.ttft_ms['p50']:.2f}",
                          f"{m.ttft_ms['p99']:.2f}",
                          *(f"{tpot[k]:.2f}" if k in tpot else "-" for k in ("p50", "p99")),
                          f"{m.latency_us['p50'] / 1e3:,.1f}",
                          "-" if m.speedup is None else f"{m.speedup:.2f}x",
                          "-" if m.capture_s is None else f"{m.capture_s:.3f}",
                          {True: "passed", False: "FAILED", None: "-"}[m.verify])
    return table
