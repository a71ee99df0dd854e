"""Step latency: eager vs the seed's hand-written CUDA graph loop vs graphrun vs torch.compile.

    python3 benchmarks/bench_capture.py [--models decoder,mlp] [--batches 1,8,32,128]
        [--iters 200] [--skip-compile] [--compile-batches 1,32] [--capture-sizes 1,8,32,128]
        [--out benchmarks/RESULTS-capture.md] [--smoke]

Per model (builtin decoder 12 x 768, KV cache 512; builtin MLP 24 x 1024; bf16) and batch, the
median per-step host wall time (each step ends synchronized) of:
  a   eager: pinned host inputs -> device -> model -> pinned host outputs -> synchronize
  b   the seed's loop: static inputs, 3 warm-up runs on a side stream, torch.cuda.graph capture,
      then copy_ into the static inputs, g.replay(), copy_ out, synchronize
  b32 the same graph, host tensors in float32 where the model's are bf16 (a conversion on the
      device per copy in, float32 outputs): what run_batch does with float32 tensors
  c   graphrun: Runner.run_batch on pinned host tensors in the model's dtypes (as b passes
      them; graphrun's static buffers hold the model's dtypes, so a plain copy; outputs come
      back as pinned tensors in the model's dtype), on float32 tensors where the model takes
      bf16 (cast on the copy, as b32), on device tensors with device=True (+ a synchronize),
      and on numpy arrays (converted to bf16 as they are staged; outputs float32); and the
      file path's inner launch (launch + wait, copy streams) with the staging filled
  d   torch.compile(mode="reduce-overhead", dynamic=False) with a's copies (--compile-batches)
  e   graphrun with model.compile: true (--compile-batches)
and, for the decoder, capture time and memory for 1..n buckets, shared pool vs a pool per graph,
against the largest bucket captured alone. Every variant's output is checked against eager.
--smoke: tiny models and few steps, runs on a CPU (graph variants are skipped with a note).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphrun.models.load import build_model  # noqa: E402
from graphrun.engine import Runner  # noqa: E402
from graphrun.spec.keys import PipelineSpec  # noqa: E402

N_SETS = 8  # distinct random input sets per batch, cycled through the timed steps
ATOL = RTOL = 2e-2  # bf16 logits


# -- the models -----------------------------------------------------------------------------

@dataclass
class Case:
    name: str
    builtin: str
    args: dict
    inputs: dict  # spec inputs
    outputs: dict  # spec outputs
    out_name: str

    def numpy_sets(self, batch: int, n: int) -> list[dict[str, np.ndarray]]:
        """n distinct random input sets of `batch` rows (never zeros), seeded per batch."""
        rng = np.random.default_rng(1000 + batch)
        sets = []
        for _ in range(n):
            if self.builtin == "decoder":
                sets.append({
                    "tokens": rng.integers(0, self.args["vocab"], (batch, 1), dtype=np.int64),
                    "positions": rng.integers(0, self.args["max_len"], (batch,), dtype=np.int64)})
            else:
                sets.append({"x": rng.standard_normal((batch, self.args["in_features"]),
                                                      dtype=np.float32)})
        return sets


def make_cases(smoke: bool) -> dict[str, Case]:
    if smoke:
        dec = {"layers": 2, "d_model": 64, "heads": 4, "vocab": 512, "max_len": 64}
        mlp = {"in_features": 64, "hidden": 64, "layers": 2, "out_features": 32}
    else:
        dec = {"layers": 12, "d_model": 768, "heads": 12, "vocab": 32000, "max_len": 512}
        mlp = {"in_features": 1024, "hidden": 1024, "layers": 24, "out_features": 1024}
    return {
        "decoder": Case(
            "decoder", "decoder", dec,
            {"tokens": {"shape": ["batch", 1], "dtype": "int64", "range": [0, dec["vocab"]]},
             "positions": {"shape": ["batch"], "dtype": "int64", "range": [0, dec["max_len"]]}},
            {"logits": {"shape": ["batch", 1, dec["vocab"]]}}, "logits"),
        "mlp": Case(
            "mlp", "mlp", mlp,
            {"x": {"shape": ["batch", mlp["in_features"]], "dtype": "bfloat16"}},
            {"y": {"shape": ["batch", mlp["out_features"]]}}, "y"),
    }


def make_spec(case: Case, buckets, tmp: Path, cuda: bool, *, pool: str = "shared",
              compile_: bool = False, verify: bool = True) -> PipelineSpec:
    data = tmp / "dummy.jsonl"
    if not data.exists():
        data.write_text('{"id": 0}\n')
    return PipelineSpec.model_validate({
        "version": 1, "name": f"bench-{case.name}", "device": "cuda" if cuda else "cpu",
        "model": {"builtin": case.builtin, "args": case.args, "dtype": "bfloat16",
                  "compile": compile_},
        "inputs": case.inputs, "outputs": case.outputs,
        "buckets": {"batch": sorted(buckets)},
        "capture": {"backend": "cuda-graph" if cuda else "eager", "warmup_iters": 3,
                    "pool": pool, "verify": {"enabled": verify, "rtol": RTOL, "atol": ATOL},
                    "on_failure": "error"},
        "data": {"path": str(data), "batch_size": max(buckets)},
        "output": {"dir": str(tmp / "out")},
    })


# -- timing and checking ----------------------------------------------------------------------

@dataclass
class Row:
    variant: str
    batch: int
    median_us: float | None = None
    p90_us: float | None = None
    mean_us: float | None = None  # loop wall time / iters
    max_abs: float | None = None
    ok: bool | None = None
    note: str = ""


@dataclass
class Results:
    rows: dict[str, list[Row]] = field(default_factory=dict)  # per model
    notes: dict[str, list[str]] = field(default_factory=dict)
    capture: list[dict] = field(default_factory=list)
    capture_notes: list[str] = field(default_factory=list)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def time_steps(step, iters: int, warmup: int, cuda: bool, prepare=None) -> dict:
    """Run `warmup` steps, then time `iters` steps one by one (perf_counter around each; every
    step ends synchronized) and the whole loop. `prepare(i)` runs untimed before step i."""
    for i in range(warmup):
        if prepare:
            prepare(i)
        step(i)
    sync(cuda)
    times = []
    t_loop = time.perf_counter()
    for i in range(iters):
        if prepare:
            prepare(i)
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    loop = time.perf_counter() - t_loop
    us = np.asarray(times) * 1e6
    return {"median_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90)),
            "mean_us": loop * 1e6 / iters}


def compare(got, ref: torch.Tensor) -> tuple[bool, float]:
    got = torch.as_tensor(np.asarray(got)) if not isinstance(got, torch.Tensor) else got
    got = got.detach().float().cpu().reshape(ref.shape)
    diff = (got - ref).abs()
    return bool(torch.allclose(got, ref, rtol=RTOL, atol=ATOL)), float(diff.max())


def host_sets(np_sets, dtypes: dict[str, torch.dtype], cuda: bool) -> list[dict[str, torch.Tensor]]:
    """Pinned host tensors (on CUDA) of the numpy sets, in the given dtypes."""
    out = []
    for s in np_sets:
        d = {}
        for n, a in s.items():
            t = torch.from_numpy(a).to(dtypes[n])
            d[n] = t.pin_memory() if cuda else t
        out.append(d)
    return out


def copy_loop(fn, sets: list[dict[str, torch.Tensor]], device, cuda: bool,
              mark_step: bool = False):
    """a / d: copy host inputs into device tensors, fn(**inputs), copy out to pinned host, sync."""
    dev = {n: torch.empty(t.shape, dtype=t.dtype, device=device) for n, t in sets[0].items()}
    holder: dict[str, torch.Tensor] = {}

    def step(i: int) -> torch.Tensor:
        for n, t in sets[i % len(sets)].items():
            dev[n].copy_(t, non_blocking=True)
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        out = fn(**dev)
        host = holder.get("out")
        if host is None:
            host = holder["out"] = torch.empty(out.shape, dtype=out.dtype, pin_memory=cuda)
        host.copy_(out, non_blocking=True)
        sync(cuda)
        return host

    return step


def record(rows: list[Row], variant: str, batch: int, timing: dict | None, check, note=""):
    row = Row(variant, batch, note=note)
    if timing:
        row.median_us, row.p90_us, row.mean_us = (timing["median_us"], timing["p90_us"],
                                                  timing["mean_us"])
    if check is not None:
        row.ok, row.max_abs = check
    rows.append(row)
    status = "" if row.ok in (None, True) else "  OUTPUT MISMATCH"
    med = f"{row.median_us:9.1f} us" if row.median_us is not None else "        - "
    diff = f"  max|diff| {row.max_abs:.3g}" if row.max_abs is not None else ""
    print(f"  {variant:<34} B={batch:<4} {med}{diff}{status}  {note}", flush=True)
    return row


def failed(rows, variant, batch, exc: BaseException, what="failed"):
    text = f"{what}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    print(f"  {variant:<34} B={batch:<4} {text}", flush=True)
    traceback.print_exc(limit=3)
    rows.append(Row(variant, batch, note=text[:300]))


# -- cudagraph-skip detection for torch.compile ------------------------------------------------

class SkipLog(logging.Handler):
    """Collects torch log records about skipped cudagraphs ('skipping cudagraphs due to mutated
    inputs ...'). Inductor logs them as warnings through the artifact logger of
    torch._inductor.cudagraph_utils ('cudagraphs' in recent torch, 'perf_hints' in older); the
    handler sits on "torch" and "torch._inductor" (where propagating records arrive) and on
    those loggers directly (an off-by-default artifact does not propagate), so no torch log
    setting is changed. A record seen twice is reported once."""

    LOGGERS = ("torch", "torch._inductor", "torch._inductor.cudagraph_utils.__cudagraphs",
               "torch._inductor.cudagraph_utils.__perf_hints")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, rec: logging.LogRecord) -> None:
        try:
            msg = rec.getMessage()
        except Exception:  # noqa: BLE001
            return
        if "cudagraph" in msg.lower() and "skip" in msg.lower():
            self.messages.append(msg.strip().splitlines()[0])

    def __enter__(self):
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)


def skip_count() -> int:
    try:
        from torch._dynamo.utils import counters
        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # noqa: BLE001
        return 0


def raise_recompile_limit(n: int) -> None:
    import torch._dynamo.config as dynamo_config

    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, knob):
            setattr(dynamo_config, knob, max(getattr(dynamo_config, knob), n))


# -- the variants ------------------------------------------------------------------------------

def bench_model(case: Case, args, cuda: bool, device, tmp: Path, res: Results) -> None:
    rows = res.rows.setdefault(case.name, [])
    notes = res.notes.setdefault(case.name, [])
    batches, iters, warmup = args.batches, args.iters, args.warmup
    compile_batches = [b for b in args.compile_batches if b in batches]
    print(f"\n## {case.name} {case.args}", flush=True)

    # one spec for a/b/d: the same builtin, seeded, so the Runner's copy has the same weights
    spec = make_spec(case, batches, tmp, cuda)
    t0 = time.perf_counter()
    model = build_model(spec, device)
    print(f"  model built in {time.perf_counter() - t0:.1f} s", flush=True)
    model_dtypes = {n: (torch.bfloat16 if i["dtype"] == "bfloat16" else torch.int64)
                    for n, i in case.inputs.items()}
    f32_dtypes = {n: (torch.float32 if d == torch.bfloat16 else d) for n, d in model_dtypes.items()}
    np_sets = {b: case.numpy_sets(b, N_SETS) for b in batches}
    refs: dict[int, torch.Tensor] = {}

    with torch.inference_mode():
        # a. eager
        for b in batches:
            sets = host_sets(np_sets[b], model_dtypes, cuda)
            step = copy_loop(model, sets, device, cuda)
            refs[b] = step(0).float().clone()
            record(rows, "a eager", b, time_steps(step, iters, warmup, cuda), None)
            del step, sets
        free(cuda)

        # b. the seed's hand-written loop (+ b32: same graph, float32 host staging)
        if not cuda:
            notes.append("b (hand-written CUDA graph) skipped: no CUDA device.")
            print("  b hand-written graph: skipped (no CUDA device)")
        for b in batches if cuda else []:
            try:
                handwritten(model, case, np_sets[b], model_dtypes, f32_dtypes, device, refs[b],
                            b, iters, warmup, rows)
            except Exception as exc:  # noqa: BLE001
                failed(rows, "b hand-written graph (seed)", b, exc)
            free(cuda)

        # c. graphrun through its Python API and its inner replay path
        try:
            t0 = time.perf_counter()
            runner = Runner(make_spec(case, batches, tmp, cuda))
            setup = time.perf_counter() - t0
            notes.append(f"c: Runner setup (buckets {batches}, verify on) {setup:.2f} s wall; "
                         f"backend {runner.backend}.")
            graphrun_variants(runner, case, "c graphrun", batches, np_sets, refs, iters, warmup,
                              cuda, rows)
            runner.close()
            del runner
        except Exception as exc:  # noqa: BLE001
            failed(rows, "c graphrun", 0, exc)
        free(cuda)

        if args.skip_compile:
            notes.append("d, e (torch.compile) skipped: --skip-compile.")
        elif compile_batches:
            dropped = [b for b in args.compile_batches if b not in batches]
            if dropped:
                notes.append(f"--compile-batches {dropped} ignored: not in --batches.")
            notes.append(f"d, e (torch.compile) measured at batches {compile_batches} only "
                         "(--compile-batches): each shape is a separate compile.")
            compiled_variant(model, case, compile_batches, np_sets, model_dtypes, refs, iters,
                             warmup, device, cuda, rows)
            free(cuda)
            try:
                torch._dynamo.reset()
                raise_recompile_limit(len(compile_batches) + 8)
                t0 = time.perf_counter()
                runner = Runner(make_spec(case, compile_batches, tmp, cuda, compile_=True))
                setup = time.perf_counter() - t0
                notes.append(f"e: Runner setup with model.compile (buckets {compile_batches}, "
                             f"compiles included) {setup:.1f} s wall.")
                graphrun_variants(runner, case, "e graphrun compile", compile_batches, np_sets,
                                  refs, iters, warmup, cuda, rows)
                runner.close()
                del runner
            except Exception as exc:  # noqa: BLE001
                failed(rows, "e graphrun compile", 0, exc)
            torch._dynamo.reset()
            free(cuda)
        else:
            notes.append("d, e (torch.compile) skipped: no --compile-batches among --batches.")
    del model
    free(cuda)


def handwritten(model, case, np_sets, model_dtypes, f32_dtypes, device, ref, b, iters, warmup,
                rows):
    """The hand-written capture-and-replay loop (benchmarks/README.md, variant b): nothing
    from graphrun."""
    sets = host_sets(np_sets, model_dtypes, True)
    static_in = {n: torch.empty(t.shape, dtype=t.dtype, device=device) for n, t in sets[0].items()}
    for n, t in sets[0].items():
        static_in[n].copy_(t)
    # 1. warm-up on a side stream
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            static_out = model(**static_in)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    # 2./3. capture
    g = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.graph(g):
        static_out = model(**static_in)
    torch.cuda.synchronize()
    capture_ms = (time.perf_counter() - t0) * 1e3
    host_out = torch.empty(static_out.shape, dtype=static_out.dtype, pin_memory=True)

    def make_step(sets, host_out):
        def step(i):
            for n, t in sets[i % len(sets)].items():
                static_in[n].copy_(t, non_blocking=True)
            g.replay()
            host_out.copy_(static_out, non_blocking=True)
            torch.cuda.synchronize()
            return host_out
        return step

    step = make_step(sets, host_out)
    check = compare(step(0), ref)
    record(rows, "b hand-written graph (seed)", b, time_steps(step, iters, warmup, True), check,
           f"capture {capture_ms:.1f} ms")
    # b32: float32 host tensors for bf16 ones (a conversion on the device per copy)
    if any(d == torch.bfloat16 for d in model_dtypes.values()) or static_out.dtype == torch.bfloat16:
        sets32 = host_sets(np_sets, f32_dtypes, True)
        out32 = torch.empty(static_out.shape, dtype=torch.float32, pin_memory=True)
        step = make_step(sets32, out32)
        check = compare(step(0), ref)
        record(rows, "b32 hand-written, fp32 host staging", b,
               time_steps(step, iters, warmup, True), check)


def graphrun_variants(runner: Runner, case: Case, label: str, batches, np_sets, refs, iters,
                      warmup, cuda, rows) -> None:
    """run_batch on tensors and on numpy arrays (the API) and the inner launch path."""
    by_batch = {bk.batch: bk for bk in runner.table.active}
    static = runner.layout.in_dtypes  # the model's dtypes, as the hand-written loop has them
    f32 = {n: torch.float32 if d.is_floating_point else d for n, d in static.items()}
    for b in batches:
        bucket = by_batch[b]
        state = runner.states[bucket]
        status = state.status + (f" ({state.reason})" if state.reason else "")
        sets = np_sets[b]
        variants = {"run_batch(tensors)": host_sets(sets, static, cuda)}
        if f32 != static:
            variants["run_batch(tensors, float32 in)"] = host_sets(sets, f32, cuda)
        try:
            for name, tsets in variants.items():
                check = compare(runner.run_batch(tsets[0])[case.out_name], refs[b])
                timing = time_steps(lambda i: runner.run_batch(tsets[i % len(tsets)]), iters,
                                    warmup, cuda)
                record(rows, f"{label} {name}", b, timing, check, status)
            if cuda:
                dsets = [{n: t.to(runner.device) for n, t in d.items()}
                         for d in variants["run_batch(tensors)"]]

                def on_device(i):
                    out = runner.run_batch(dsets[i % len(dsets)], device=True)
                    torch.cuda.synchronize()
                    return out

                check = compare(on_device(0)[case.out_name], refs[b])
                record(rows, f"{label} run_batch(device=True)", b,
                       time_steps(on_device, iters, warmup, cuda), check, "+ synchronize")
            check = compare(runner.run_batch(sets[0])[case.out_name], refs[b])
            timing = time_steps(lambda i: runner.run_batch(sets[i % len(sets)]), iters, warmup,
                                cuda)
            record(rows, f"{label} run_batch(numpy)", b, timing, check, status)
            inner_variant(runner, case, label, bucket, sets, refs[b], iters, warmup, cuda, rows)
        except Exception as exc:  # noqa: BLE001
            failed(rows, label, b, exc)


def inner_variant(runner: Runner, case: Case, label: str, bucket, sets, ref, iters, warmup,
                  cuda, rows) -> None:
    """The file path's launch (host slot 0, copy streams, events) with the staging filled."""
    slot = runner.launcher.slots[0]

    def prepare(i):
        for n, a in sets[i % len(sets)].items():
            slot.inputs.pad_rows(n, bucket, a, 0.0)  # converted to the model's dtype

    def inner():
        return runner.launcher.launch(bucket, 0, bucket.batch, {}, timed=True).wait()

    phases: list[dict] = []
    prepare(0)
    inner()
    check = compare(slot.outputs.view(case.out_name, bucket).float().numpy(), ref)
    timing = time_steps(lambda i: phases.append(inner()), iters, warmup, cuda, prepare)
    ph = {k: np.median([p[k] for p in phases[warmup:]]) for k in ("h2d", "replay", "d2h")}
    record(rows, f"{label} inner (launch + wait)", bucket.batch, timing, check,
           "median phases h2d/replay/d2h " + "/".join(f"{ph[k]:.0f}" for k in ph) + " us")


def compiled_variant(model, case, compile_batches, np_sets, model_dtypes, refs, iters, warmup,
                     device, cuda, rows) -> None:
    """d. torch.compile(mode='reduce-overhead'): its own cudagraph trees, or skipped ones."""
    torch._dynamo.reset()
    raise_recompile_limit(len(compile_batches) + 8)
    try:
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
    except Exception as exc:  # noqa: BLE001
        failed(rows, "d torch.compile reduce-overhead", 0, exc)
        return
    for b in compile_batches:
        with SkipLog() as log:
            skips0 = skip_count()
            try:
                sets = host_sets(np_sets[b], model_dtypes, cuda)
                step = copy_loop(compiled, sets, device, cuda, mark_step=True)
                t0 = time.perf_counter()
                step(0)  # compiles
                first_s = time.perf_counter() - t0
                for i in range(max(5, warmup)):
                    step(i)
                check = compare(step(0), refs[b])
                timing = time_steps(step, iters, warmup, cuda)
            except Exception as exc:  # noqa: BLE001
                failed(rows, "d torch.compile reduce-overhead", b, exc)
                continue
        skipped = skip_count() - skips0
        note = f"first call {first_s:.1f} s"
        if skipped or log.messages:
            why = "; ".join(dict.fromkeys(log.messages)) or f"{skipped} cudagraph skip(s) counted"
            note += f"; skipped cudagraphs: {why[:200]}"
        elif cuda:
            note += "; cudagraphs used"
        record(rows, "d torch.compile reduce-overhead", b, timing, check, note)
        del step, sets
    del compiled


# -- capture time and memory ---------------------------------------------------------------------

def bench_capture(case: Case, sizes, tmp: Path, res: Results) -> None:
    """Runner per bucket list range(1, n+1), pool shared and per-graph, vs buckets [n] alone."""
    print(f"\n## capture: {case.name}, buckets 1..n", flush=True)
    res.capture_notes.append(
        f"{case.name} {case.args}; capture_s and memory_bytes summed over the Runner's bucket "
        "states (memory: growth of torch.cuda.memory_reserved per capture); setup = Runner() "
        "wall time with verify off (model build, buffers, warm-up, capture).")
    alone: dict[int, dict] = {}
    for n in sizes:
        for pool in ("shared", "per-graph"):
            buckets = list(range(1, n + 1))
            if n == 1 and pool == "per-graph":
                continue  # one bucket: the pool mode makes no difference
            row = one_capture(case, n, buckets, pool, tmp)
            if n == 1:
                alone[1] = row
            res.capture.append(row)
            print(f"  {row['label']}", flush=True)
        if n not in alone:
            alone[n] = one_capture(case, n, [n], "shared", tmp)
        for row in res.capture:
            if row["n"] == n:
                a = alone[n]
                row["alone_capture_s"], row["alone_mib"] = a["capture_s"], a["mib"]
                row["x_capture"] = row["capture_s"] / a["capture_s"] if a["capture_s"] else None
                row["x_mib"] = row["mib"] / a["mib"] if a["mib"] else None


def one_capture(case: Case, n: int, buckets, pool: str, tmp: Path) -> dict:
    free(True)
    before = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    runner = Runner(make_spec(case, buckets, tmp, True, pool=pool, verify=False))
    setup = time.perf_counter() - t0
    states = list(runner.states.values())
    captured = sum(s.status == "captured" for s in states)
    row = {
        "n": n,
        "buckets": f"[{buckets[0]}..{buckets[-1]}]" if len(buckets) > 1 else f"[{buckets[0]}]",
        "pool": pool, "graphs": captured,
        "capture_s": sum(s.capture_s or 0.0 for s in states),
        "warmup_s": sum(s.warmup_s or 0.0 for s in states),
        "mib": sum(s.memory_bytes or 0 for s in states) / 2**20,
        "setup_s": setup,
        "reserved_mib": (torch.cuda.memory_reserved() - before) / 2**20,
    }
    row["label"] = (f"{row['buckets']:>10} pool {pool:<9}: {captured} graphs, capture "
                    f"{row['capture_s']:.3f} s, {row['mib']:.1f} MiB, setup {setup:.1f} s")
    runner.close()
    del runner
    free(True)
    return row


# -- report --------------------------------------------------------------------------------------

def fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def model_table(rows: list[Row]) -> str:
    hand = {r.batch: r.median_us for r in rows if r.variant.startswith("b hand") and r.median_us}
    eager = {r.batch: r.median_us for r in rows if r.variant == "a eager" and r.median_us}
    order = {}
    for r in rows:
        order.setdefault(r.variant, len(order))
    lines = ["| batch | variant | median us | p90 us | loop mean us | time / hand-written | "
             "speedup vs eager | max abs diff vs eager | note |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r.batch, order[r.variant])):
        vs_hand = (r.median_us / hand[r.batch]) if r.median_us and r.batch in hand else None
        vs_eager = (eager[r.batch] / r.median_us) if r.median_us and r.batch in eager else None
        diff = fmt(r.max_abs, ".2e") + ("" if r.ok in (None, True) else " **MISMATCH**")
        lines.append(f"| {r.batch} | {r.variant} | {fmt(r.median_us)} | {fmt(r.p90_us)} | "
                     f"{fmt(r.mean_us)} | {fmt(vs_hand, '.2f')}{'x' if vs_hand else ''} | "
                     f"{fmt(vs_eager, '.2f')}{'x' if vs_eager else ''} | {diff} | {r.note} |")
    return "\n".join(lines)


def capture_table(rows: list[dict]) -> str:
    lines = ["| buckets | pool | graphs | capture s (sum) | warm-up s (sum) | graph MiB (sum) | "
             "largest alone: capture s | largest alone: MiB | capture x alone | MiB x alone | "
             "setup s | reserved MiB after setup |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['buckets']} | {r['pool']} | {r['graphs']} | {r['capture_s']:.3f} | "
            f"{r['warmup_s']:.3f} | {r['mib']:.1f} | {fmt(r.get('alone_capture_s'), '.3f')} | "
            f"{fmt(r.get('alone_mib'))} | {fmt(r.get('x_capture'), '.2f')} | "
            f"{fmt(r.get('x_mib'), '.2f')} | {r['setup_s']:.1f} | {r['reserved_mib']:.0f} |")
    return "\n".join(lines)


def environment(cuda: bool) -> list[str]:
    env = [f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
           f"host: {platform.node()}; python {platform.python_version()}; numpy {np.__version__}",
           f"torch {torch.__version__}; CUDA {torch.version.cuda}; "
           f"cuDNN {torch.backends.cudnn.version() if cuda else None}"]
    if cuda:
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.append(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, "
                   f"{p.multi_processor_count} SMs; driver {_driver()}")
    else:
        env.append("GPU: none (CPU run)")
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        env.append(f"graphrun commit: {rev or 'unknown'}{' (uncommitted changes)' if dirty else ''}")
    except Exception:  # noqa: BLE001
        pass
    env.append("command: python3 " + " ".join(sys.argv))
    return env


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        return out.splitlines()[0] if out else "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def report(res: Results, args, cuda: bool) -> str:
    parts = ["# bench_capture: step latency and capture cost", "",
             *[f"- {e}" for e in environment(cuda)], "",
             f"Per step: host wall time (perf_counter) around one step that ends synchronized; "
             f"{args.iters} timed steps after {args.warmup} warm-up steps per variant, "
             f"{N_SETS} distinct random input sets cycled. 'time / hand-written' = median / "
             "median of b (1.00x = as fast as the seed's loop); 'speedup vs eager' = a's median / "
             f"median. Outputs checked against a (eager) with rtol = atol = {RTOL:g}.",
             "graphrun holds inputs in the model's dtype in its static buffers and host slots "
             "(a floating input of a bf16 model in bf16); its static outputs are in the model's "
             "dtype. run_batch(tensors) passes pinned tensors in those dtypes, as b does (a plain "
             "copy), run_batch(tensors, float32 in) float32 ones for bf16 inputs (cast on the "
             "copy, one kernel); both return pinned bf16 tensors. run_batch(numpy) converts "
             "to bf16 as it stages and returns float32. b32 is the seed's loop with float32 "
             "host tensors for inputs and outputs.",
             "run_batch runs on the caller's stream and ends in one blocking copy; the inner "
             "launch (the file path's) uses copy streams and records 4 CUDA events per step for "
             "its phase timings; a/b/d steps end in torch.cuda.synchronize()."]
    if args.smoke:
        parts.append("**--smoke: tiny models, few steps; the numbers mean nothing.**")
    for name, rows in res.rows.items():
        parts += ["", f"## {name}", "", *[f"- {n}" for n in res.notes.get(name, [])], "",
                  model_table(rows)]
    parts += ["", "## capture: time and memory per bucket list", ""]
    parts += [f"- {n}" for n in res.capture_notes]
    if res.capture:
        parts += ["", capture_table(res.capture)]
    return "\n".join(parts) + "\n"


# -- main ----------------------------------------------------------------------------------------

def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--models", default="decoder,mlp")
    ap.add_argument("--batches", type=ints, default=None, help="default 1,8,32,128")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 200)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 20)")
    ap.add_argument("--skip-compile", action="store_true", help="skip d and e")
    ap.add_argument("--compile-batches", type=ints, default=None, help="default 1,32")
    ap.add_argument("--capture-sizes", type=ints, default=None,
                    help="bucket lists 1..n for the decoder's capture table (default 1,8,32,128;"
                         " '' to skip)")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    ap.add_argument("--smoke", action="store_true", help="tiny models, few steps (CPU ok)")
    args = ap.parse_args()
    args.batches = args.batches or [1, 8, 32, 128]
    args.iters = args.iters or (5 if args.smoke else 200)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.smoke else 20)
    args.compile_batches = (args.compile_batches if args.compile_batches is not None
                            else ([1] if args.smoke else [1, 32]))
    args.capture_sizes = (args.capture_sizes if args.capture_sizes is not None
                          else ([1, 4] if args.smoke else [1, 8, 32, 128]))

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cases = make_cases(args.smoke)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in cases]
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {list(cases)}")
    print("\n".join(environment(cuda)), flush=True)
    res = Results()
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for m in models:
            bench_model(cases[m], args, cuda, device, tmp, res)
        if not args.capture_sizes:
            res.capture_notes.append("skipped (--capture-sizes '').")
        elif not cuda:
            res.capture_notes.append("skipped: no CUDA device (capture needs one).")
            print("\n## capture table: skipped (no CUDA device)")
        else:
            try:
                with torch.inference_mode():
                    bench_capture(cases["decoder"], args.capture_sizes, tmp, res)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                res.capture_notes.append(f"failed: {type(exc).__name__}: {exc}")
    text = report(res, args, cuda)
    text += f"\nTotal benchmark wall time: {time.perf_counter() - t_all:.0f} s.\n"
    print("\n" + text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"written: {args.out}")


if __name__ == "__main__":
    main()
