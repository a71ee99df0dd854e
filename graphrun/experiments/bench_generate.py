"""`graphrun bench SPEC` for a generation spec: per (batch bucket, prompt bucket), prefill and
decode timed through the engine (generate/engine.py) on the model as a generation job builds
it, no output shards: a call is `batch` prompts of the prompt bucket's length, all admitted at
once (the slots are the largest batch bucket).

Each bucket's prompts are synthetic (seeded token ids, every prompt the bucket's full length)
and every row makes exactly `new_tokens` tokens (min_new_tokens = max_new_tokens, so a stop id
never ends a batch early and every iteration does the same work). Per bucket and mode: one call
that sets up its graphs (their capture time is the row's capture_s), all before any timing; then
`repeats` times, the modes alternating per bucket, `warmup` untimed calls and `iters` timed ones
over `distinct` prompt sets in turn. Modes: eager (the eager backend), on a GPU graph
(capture.backend: prefill and decode steps replayed; compiled where the spec says
model.compile), and with --compile, compile: the steps under model.compile (replayed on a GPU,
run directly on the CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np
import torch

from graphrun.base.errors import SpecError, Problem
from graphrun.engine.verify import synthetic_values
from graphrun.experiments.bench import (PERCENTILES, Bench, BucketBench, ModeResult, Session,
                                        default_repeats, judge, open_sessions, round_robin,
                                        title_of, speedup_text)
from graphrun.experiments.stats import range_text, spread
from graphrun.spec.generate import PROMPT_AXIS
from graphrun.spec.keys import BATCH, PipelineSpec


def refuse(option: str, why: str) -> SpecError:
    return SpecError([Problem(f"graphrun bench {option}", "", why)])


def bench_generation(spec: PipelineSpec, *, iters: int = 20, warmup: int = 2,
                     distinct: int = 2, new_tokens: int | None = None,
                     repeats: int | None = None, compile: bool = False, log=print) -> Bench:
    """The Bench of a generation spec (spec.generate set): one row per bucket and mode."""
    from graphrun.engine.device import resolve_backend, resolve_device
    from graphrun.generate.runner import build_generation_model, generate_config

    new = new_tokens or spec.generate.max_new_tokens
    device = resolve_device(spec.device)
    repeats = repeats or default_repeats(device)
    cuda = device.type == "cuda"
    model, _ = build_generation_model(spec, device)
    config = dataclasses.replace(generate_config(spec, model), max_new_tokens=new,
                                 min_new_tokens=new)
    backend = resolve_backend(spec.capture.backend, device)
    modes = [("eager", "eager", False)]
    notes = [f"every row makes {new} new tokens (min_new_tokens = max_new_tokens = {new})"]
    if cuda:
        modes.append(("graph", backend, spec.model.compile))
    else:
        notes.append("no CUDA device: the eager backend only, graph replay not measured")
    if compile:
        modes.append(("compile", backend, True))
    sizes = [(b, p) for b in sorted(spec.buckets[BATCH]) for p in sorted(spec.buckets[PROMPT_AXIS])]
    gens: list = []
    try:
        sessions = open_sessions(
            [(mode, functools.partial(_open_mode, spec, model, config, device, mode, backend,
                                      compiled, sizes, distinct, gens, notes))
             for mode, backend, compiled in modes],
            notes, log)
        got = round_robin(sessions, sizes, repeats,
                          lambda s, key: _time_calls(s.steps[key], iters, warmup, distinct),
                          notes, log)
    finally:
        for gen in gens:
            gen.close()
    rows = []
    for b, p in sizes:
        ran = []
        for s in sessions:
            per_repeat = got[s.mode].get((b, p))
            if not per_repeat:
                continue
            walls = [w for r in per_repeat for w in r["walls"]]
            tpot = [t for r in per_repeat for t in r["tpot"]]
            cost = s.costs[(b, p)]
            ran.append(ModeResult(
                mode=s.mode, backend=s.backend[(b, p)], latency_us=_pcts(walls, 1e6),
                p50_spread_us=spread([float(np.percentile(r["walls"], 50)) * 1e6
                                      for r in per_repeat]),
                output_tokens_per_s=sum(r["tokens"] for r in per_repeat) / sum(walls),
                output_tokens_per_s_spread=spread([r["tokens"] / sum(r["walls"])
                                                   for r in per_repeat]),
                ttft_ms=_pcts([t for r in per_repeat for t in r["ttft"]], 1e3),
                tpot_ms=_pcts(tpot, 1e3) if tpot else None, **cost))
        rows.append(BucketBench(name=f"{BATCH}={b},{PROMPT_AXIS}={p}",
                                sizes={BATCH: b, PROMPT_AXIS: p}, modes=ran, fastest=judge(ran)))
    return Bench(spec=str(spec.source_path or spec.name), device=str(device), iters=iters,
                 warmup=warmup, repeats=repeats, distinct=distinct,
                 inputs=f"synthetic prompts (seeded token ids) of each prompt bucket's length, "
                 f"{new} new tokens a row", notes=notes, buckets=rows, new_tokens=new)


def _open_mode(spec, model, config, device, mode: str, backend: str, compiled: bool,
               sizes: list, distinct: int, gens: list, notes: list[str]) -> Session:
    """One engine over all the buckets, its graphs set up at its construction (each bucket's
    row carries the decode graph of its rows and the prefill graph of its tokens); a compiled
    graph that fell back to the plain model is named in the notes."""
    from graphrun.generate.engine import Engine

    batch, seq = sorted(spec.buckets[BATCH]), sorted(spec.buckets[PROMPT_AXIS])
    gen = Engine(model, config=config, slots=batch[-1], max_prompt=seq[-1], rows=batch,
                 prompts=seq, prefill_tokens=batch[-1] * seq[-1], device=device,
                 dtype=spec.model.dtype, backend=backend, verify=spec.capture.verify.enabled,
                 memory_budget_mib=spec.capture.memory_budget_mib, compile=compiled)
    gens.append(gen)
    vocab = gen.model.vocab
    session = Session(mode)
    graphs = backend == "cuda-graph"
    for b, p in sizes:
        sets = [synthetic_prompts(b, p, vocab, seed) for seed in range(distinct)]
        rows = next(n for n in gen.decode_sizes if n >= b)
        tokens = next(t for t in gen.prefill_sizes if t >= min(b * p, gen.prefill_sizes[-1]))
        new = [g for g in gen.graphs()
               if (g["kind"], g["shape"][g["axis"]]) in (("decode", rows), ("prefill", tokens))]
        checks = [g["verify"].get("passed") for g in new if g["verify"]]
        session.steps[(b, p)] = functools.partial(_call, gen, list(range(b))), sets
        session.costs[(b, p)] = {
            "capture_s": sum(g["capture_s"] or 0.0 for g in new) if graphs else None,
            "memory_bytes": sum(g["memory_bytes"] or 0 for g in new) if graphs else None,
            "verify": all(checks) if checks else None}
        fell_back = [g for g in new if g["compiled"] is False]
        for g in fell_back:  # one note per reason, naming the first graph it held
            if not any(n.endswith(f": {g['reason']}") for n in notes):
                notes.append(f"{mode}: {g['kind']} {_shape(g)} and others like it: "
                             f"{g['reason']}")
        session.backend[(b, p)] = backend + (
            " + torch.compile" if compiled and len(fell_back) < len(new) else "")
    return session


def _call(gen, ids: list, prompts: list[list[int]]) -> dict:
    """One generate call: its prefill time (the TTFT of its prompts, all admitted at once),
    decode time and steps, new tokens, from the engine's running sums."""
    s = gen.stats
    before = (s.prefill_s, s.decode_s, s.decode_steps, s.output_tokens)
    gen.generate(prompts, ids)
    return {"ttft_s": s.prefill_s - before[0], "decode_s": s.decode_s - before[1],
            "decode_steps": s.decode_steps - before[2], "tokens": s.output_tokens - before[3]}


def _shape(g: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in g["shape"].items())


def _time_calls(step, iters: int, warmup: int, distinct: int) -> dict:
    """One repeat of a bucket: warm-up calls, then timed ones; their walls, TTFTs, TPOTs and
    new tokens."""
    call, sets = step
    for i in range(warmup):
        call(sets[i % distinct])
    walls, ttft, tpot, tokens = [], [], [], 0
    for i in range(iters):
        t0 = time.perf_counter()
        r = call(sets[i % distinct])
        walls.append(time.perf_counter() - t0)
        ttft.append(r["ttft_s"])
        if r["decode_steps"]:
            tpot.append(r["decode_s"] / r["decode_steps"])
        tokens += r["tokens"]
    return {"walls": walls, "ttft": ttft, "tpot": tpot, "tokens": tokens}


def synthetic_prompts(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """rows prompts of `length` seeded token ids in [1, vocab)."""
    gen = torch.Generator().manual_seed(seed)
    return synthetic_values("int64", (1, vocab), (rows, length), gen).tolist()


def _pcts(values: list[float], scale: float) -> dict[str, float]:
    return {f"p{p}": float(np.percentile(values, p)) * scale for p in PERCENTILES}


def generation_table(result: Bench):
    from rich.table import Table

    table = Table(title=title_of(result, "generate calls", "prompt sets"))
    for col in ("bucket", "mode", "backend", "tokens/s", "tokens/s range", "TTFT p50 ms",
                "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "call p50 ms", "speedup",
                "capture s", "verify"):
        table.add_column(col, justify="left" if col in ("bucket", "mode", "backend")
                         else "right")
    for b in result.buckets:
        for i, m in enumerate(b.modes):
            tpot = m.tpot_ms or {}
            table.add_row(b.name if i == 0 else "", m.mode, m.backend,
                          f"{m.output_tokens_per_s:,.0f}",
                          range_text(m.output_tokens_per_s_spread, ",.0f"),
                          f"{m.ttft_ms['p50']:.2f}", f"{m.ttft_ms['p99']:.2f}",
                          *(f"{tpot[k]:.2f}" if k in tpot else "-" for k in ("p50", "p99")),
                          f"{m.latency_us['p50'] / 1e3:,.1f}", speedup_text(m),
                          "-" if m.capture_s is None else f"{m.capture_s:.3f}",
                          {True: "passed", False: "FAILED", None: "-"}[m.verify])
    return table
