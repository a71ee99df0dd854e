"""One decode step of graphrun's generation engine at R rows, timed and taken apart: step time,
MBU, the step against its matrix multiplies alone, and (on a GPU, --profile) the kernels a
captured step runs; for the plain model and model.compile, with the paged decode kernel or the
reference attention path, with the fused elementwise kernels or torch's ops (issue 48's step
target).

    python3 benchmarks/bench_decode_step.py [--layout 1.24B] [--rows 64] [--kv-len 512]
        [--ways matmuls,plain,plain-unfused,plain-general,compile,compile-general]
        [--steps 32] [--repeats 10] [--profile] [--top 16] [--sample] [--json FILE]
        [--smoke]

Model: graphrun's builtin Llama in a Llama layout with seeded weights, built on the device
(nothing is downloaded or saved): 134M (12 x 768, 12 heads, ffn 2048, vocab 32000), 1.24B
(16 x 2048, 32 heads, 8 KV heads, ffn 8192, vocab 128256) or 8B (32 x 4096, 32 heads, 8 KV
heads, ffn 14336, vocab 128256; 16 GB of bf16 weights).

Ways:
- plain, compile (model.compile: true): an Engine with R slots and one decode graph of R rows
  (generate/engine.py), set up (captured and verified) as a job's are. Then every slot is
  occupied: row r holds its own blocks, KV length --kv-len (a comma list is cycled over the
  rows), a seeded token, and a cache of seeded keys and values. A repeat resets those rows and
  replays the decode graph --steps times between two CUDA events; step time = the median over
  --repeats repeats of (elapsed / steps), after one repeat of warm-up. Every repeat starts from
  the same state, so it must pick the same tokens.
- either with `-general`: the paged decode kernel switched off (paged_attention.usable), so
  attention runs paged_decode_reference (the blocks gathered, then scaled_dot_product_attention).
- plain-torch-pick: plain with the pick's kernels switched off (generate/sampling.py: the
  argmaxes and the draw's noise as torch's ops; and the bookkeeping after it, steps.advance).
- plain-unfused: plain with the fused elementwise kernels switched off (Llama.fused_kernels,
  models/causal/fused.py): the residual adds, RMSNorms, RoPE and silu(gate) * up as torch's ops.
  (Under model.compile inductor fuses those ops itself, so the compile ways never run them.)
- matmuls: the anchor. The layout's linears at R rows as bf16 matrix multiplies: per layer q,
  k, v, o, gate, up, down (unfused), then the lm_head, captured in ONE CUDA graph and timed the
  same way. Each other way prints its step / this (issue 48: <= 1.3x at 8B, 256 rows).

MBU = the bytes a step reads (the weights once: generate/mbu.weight_bytes_per_step, plus each
row's keys and values: mbu.kv_bytes_per_token x its KV length) / step time / the GPU's peak
bandwidth; for matmuls, the matrices' bytes. --profile: torch.profiler over one repeat of
replays, the kernels per step with their device time, the largest --top; the table gains a
column of kernels per step.
--sample: each row samples (seeded, temperature 1: the Gumbel-max draw a sampled job's step
makes) instead of picking greedily.
--smoke: the tiny layout on whatever device there is, 4 rows, 4 steps, 3 repeats, the ways
without compile.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {
    "134M": dict(layers=12, d_model=768, heads=12, kv_heads=12, ffn=2048, vocab=32000),
    "1.24B": dict(layers=16, d_model=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256),
    "8B": dict(layers=32, d_model=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "tiny": dict(layers=2, d_model=64, heads=4, kv_heads=2, ffn=128, vocab=512),
}
WAYS = ("matmuls", "plain", "plain-unfused", "plain-torch-pick", "plain-general", "compile",
        "compile-general")
BLOCK = 16  # KV block size, the spec's default


class Clock:
    """Elapsed seconds of a run of work: CUDA events on a GPU, the host's clock elsewhere."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def time(self, work) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            work()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def timed(reset, replay, steps: int, repeats: int, clock: Clock, after=lambda: None):
    """(median, min) seconds a replay over `repeats` repeats of `steps` replays, each after
    reset() and followed by after(), one more repeat first as warm-up."""
    seconds = []
    for i in range(repeats + 1):
        reset()

        def run():
            for _ in range(steps):
                replay()

        s = clock.time(run) / steps
        after()
        if i:
            seconds.append(s)
    return statistics.median(seconds), min(seconds)


def peak(device: torch.device) -> float | None:
    from graphrun.generate.mbu import peak_bandwidth

    return peak_bandwidth(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


@torch.no_grad()
def run_matmuls(layout: str, rows: int, steps: int, repeats: int, device: torch.device,
                dtype: torch.dtype, profile: bool = False, top: int = 16) -> dict:
    """The anchor: every linear of the layout and the lm_head at `rows` rows, one graph."""
    s = LAYOUTS[layout]
    d, f, v = s["d_model"], s["ffn"], s["vocab"]
    head = d // s["heads"]
    kv = s["kv_heads"] * head
    # (in, out) of q, k, v, o, gate, up, down
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)] * s["layers"]
    shapes.append((d, v))
    gen = torch.Generator(device).manual_seed(0)
    inputs = {n: torch.randn(rows, n, generator=gen, device=device, dtype=dtype)
              for n in {i for i, _ in shapes}}
    weights = [torch.randn(o, i, generator=gen, device=device, dtype=dtype) * 0.02
               for i, o in shapes]

    def multiply():
        for (i, _), w in zip(shapes, weights):
            F.linear(inputs[i], w)

    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    replay, status = multiply, "eager"
    if cuda:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            multiply()  # warm-up: cuBLAS picks its kernels outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            multiply()
        replay, status = graph.replay, "captured"
    set_up_s = time.perf_counter() - t0
    step, least = timed(lambda: None, replay, steps, repeats, Clock(cuda))
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flops = 2 * rows * sum(i * o for i, o in shapes)
    p = peak(device)
    extra = {"kernels": kernel_table(replay, steps, top)} if profile and cuda else {}
    return {**extra, "way": "matmuls", "layout": layout, "rows": rows, "set_up_s": set_up_s,
            "step_ms": step * 1e3, "step_min_ms": least * 1e3, "weight_bytes": nbytes,
            "kv_bytes": 0, "mbu": nbytes / step / p if p else None,
            "tflops": flops / step / 1e12, "matmuls": len(shapes), "same_tokens": None,
            "graphs": [{"kind": "matmuls", "shape": {"rows": rows}, "status": status,
                        "compiled": None, "reason": None}],
            "attention_failure": None, "fused_failure": None}


def build_model(layout: str, max_len: int, device: torch.device, dtype: torch.dtype):
    from graphrun.models.causal.llama import build_llama

    model = build_llama(**LAYOUTS[layout], max_len=max_len, seed=0, device=device, dtype=dtype)
    return model.requires_grad_(False)  # as models/load.py leaves a job's model


@torch.no_grad()  # as Engine.serve steps
def run_way(way: str, model, layout: str, rows: int, kv_lens: list[int], steps: int,
            repeats: int, device: torch.device, dtype: torch.dtype, profile: bool,
            top: int, sample: bool = False) -> dict:
    from graphrun.generate import sampling
    from graphrun.generate.config import GenerateConfig, Sampling
    from graphrun.generate.engine import build_engine
    from graphrun.generate.graphs import StepKey
    from graphrun.generate.mbu import kv_bytes_per_token, weight_bytes_per_step
    from graphrun.generate.steps import HOST_FIELDS
    from graphrun.models.causal import fused, paged_attention

    general = way.endswith("-general")
    kernel = paged_attention.usable
    if general:
        paged_attention.usable = lambda q: False
    model.fused_kernels = way != "plain-unfused"
    if way == "plain-torch-pick":
        sampling.SWITCH.failures.append("switched off by the benchmark")
    try:
        longest = max(kv_lens)
        t0 = time.perf_counter()
        # max_new_tokens: each row stays live through a repeat's steps
        how = Sampling(method="sample", temperature=1.0, seed=0) if sample else Sampling()
        engine = build_engine(model, GenerateConfig(max_new_tokens=steps + 1, sampling=how),
                              slots=rows,
                              max_prompt=longest, device=device, dtype=dtype, rows=[rows],
                              prompts=[longest], block_size=BLOCK,
                              compile=way.startswith("compile"))
        set_up_s = time.perf_counter() - t0
        st = engine.state
        lens = [kv_lens[r % len(kv_lens)] for r in range(rows)]
        for r in range(rows):  # each row its own blocks, enough for its length and the steps
            blocks = engine.blocks.take(-(-(lens[r] + steps) // BLOCK))
            st.host["block_table"][r, :len(blocks)] = blocks
        st.host["max_new"][:rows] = steps + 1
        st.push(HOST_FIELDS)
        gen = torch.Generator(device).manual_seed(2)
        for t in (*engine.cache.k, *engine.cache.v):  # keys and values the rows attend over
            t.normal_(generator=gen)
        tokens = torch.randint(5, model.vocab - 1, (rows,), generator=gen, device=device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        entry = engine.table[StepKey("decode", rows)]
        picked = []

        def reset():
            st.token[:rows].copy_(tokens)
            st.seq_lens[:rows].copy_(seq_lens)
            st.index[:rows].zero_()
            st.done[:rows].fill_(False)

        step, least = timed(reset, entry.run, steps, repeats, Clock(device.type == "cuda"),
                            after=lambda: picked.append(st.token[:rows].tolist()))
        weights = weight_bytes_per_step(model)
        lay = model.layout
        kv = kv_bytes_per_token(lay.layers, lay.kv_heads, lay.head_dim,
                                torch.empty((), dtype=dtype).element_size()) * (
            sum(lens) + rows * (steps - 1) / 2)  # the mean length over a repeat's steps
        p = peak(device)
        row = {"way": way, "layout": layout, "rows": rows, "kv_len": kv_lens,
               "set_up_s": set_up_s, "step_ms": step * 1e3, "step_min_ms": least * 1e3,
               "weight_bytes": weights, "kv_bytes": int(kv),
               "mbu": (weights + kv) / step / p if p else None,
               "same_tokens": len(picked) == repeats + 1 and all(
                   t == picked[0] for t in picked),
               "graphs": [{k: e[k] for k in ("kind", "shape", "status", "compiled", "reason")}
                          for e in engine.graphs()],
               "attention_failure": paged_attention.failure(),
               "fused_failure": fused.failure()}
        if profile and device.type == "cuda":
            reset()
            row["kernels"] = kernel_table(entry.run, steps, top)
        engine.close()
        return row
    finally:
        paged_attention.usable = kernel
        model.fused_kernels = True
        if way == "plain-torch-pick":
            sampling.SWITCH.failures.clear()


def kernel_table(replay, steps: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    return {"launches_per_step": sum(e.count for e in kernels) / steps,
            "device_us_per_step": sum(e.self_device_time_total for e in kernels) / steps,
            "top": [{"name": e.key[:120], "us_per_step": e.self_device_time_total / steps,
                     "calls_per_step": e.count / steps} for e in rows]}


def kv_list(text: str) -> list[int]:
    try:
        lens = [int(x) for x in text.split(",")]
    except ValueError:
        lens = []
    if not lens or min(lens) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give KV lengths of 1 or more, "
                                         "comma-separated (512 or 128,512)")
    return lens


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of 1 or more")
    return int(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="1.24B", choices=sorted(LAYOUTS))
    ap.add_argument("--rows", type=positive, default=64)
    ap.add_argument("--kv-len", type=kv_list, default=[512])
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--steps", type=positive, default=32)
    ap.add_argument("--repeats", type=positive, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--json", default=str(Path(os.environ.get("OUT", ".")) /
                                          "bench_decode_step.json"))
    ap.add_argument("--sample", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    ways = a.ways.split(",")
    bad = [w for w in ways if w not in WAYS]
    if bad:
        ap.error(f"--ways: unknown {bad}; give some of {', '.join(WAYS)}")
    if a.smoke:
        a.layout, a.rows, a.kv_len, a.steps, a.repeats = "tiny", 4, [5, 20], 4, 3
        ways = [w for w in ways if not w.startswith("compile")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    kv = ",".join(map(str, a.kv_len))
    print(f"# bench_decode_step: {name}, torch {torch.__version__}, layout {a.layout}, "
          f"{a.rows} rows, KV length {kv}, {a.steps} steps x {a.repeats} repeats, "
          f"{'sampled' if a.sample else 'greedy'}", flush=True)
    ways.sort(key=lambda w: w != "matmuls")  # the anchor first: every later row's ratio
    rows, model = [], None
    for way in ways:
        if way == "matmuls":
            row = run_matmuls(a.layout, a.rows, a.steps, a.repeats, device, dtype, a.profile,
                              a.top)
        else:
            if model is None:
                t0 = time.perf_counter()
                model = build_model(a.layout, max(a.kv_len) + a.steps + 1, device, dtype)
                print(f"model built in {time.perf_counter() - t0:.1f} s", flush=True)
            row = run_way(way, model, a.layout, a.rows, a.kv_len, a.steps, a.repeats, device,
                          dtype, a.profile, a.top, a.sample)
        gc.collect()  # a way's matrices, cache and graphs go before the next way's come
        if device.type == "cuda":
            torch.cuda.empty_cache()
        anchor = (rows or [row])[0]
        row["x_matmuls"] = (row["step_ms"] / anchor["step_ms"] if anchor["way"] == "matmuls"
                            else None)
        rows.append(row)
        mbu = "" if row["mbu"] is None else f"{row['mbu']:.1%}"
        ratio = "" if row["x_matmuls"] is None else f" ({row['x_matmuls']:.2f}x matmuls)"
        print(f"\n## {way}: step p50 {row['step_ms']:.3f} ms{ratio} (min "
              f"{row['step_min_ms']:.3f}), MBU {mbu or 'n/a'}, set-up {row['set_up_s']:.1f} s"
              + (f", {row['matmuls']} matrix multiplies at {row['tflops']:.0f} TFLOP/s"
                 if way == "matmuls" else "")
              + ("" if row["same_tokens"] is None
                 else f", tokens equal across repeats: {row['same_tokens']}"), flush=True)
        for e in row["graphs"]:
            if e["reason"]:
                print(f"   {e['kind']} {e['shape']}: {e['reason']}")
        if row["fused_failure"]:
            print(f"   the fused elementwise kernels failed: {row['fused_failure']}")
        k = row.get("kernels")
        if k:
            print(f"   {k['launches_per_step']:.0f} kernels a step, "
                  f"{k['device_us_per_step']:.0f} us of device time a step")
            for e in k["top"]:
                print(f"   {e['us_per_step']:8.1f} us {e['calls_per_step']:5.1f}x  {e['name']}")
    counted = any("kernels" in r for r in rows)
    print(f"\n{a.layout}, {a.rows} rows, KV length {kv}:\n"
          "| way | step p50 ms | x matmuls | MBU | set-up s |"
          + (" kernels/step |" if counted else "") + "\n|---|---:|---:|---:|---:|"
          + ("---:|" if counted else ""))
    for r in rows:
        mbu = "" if r["mbu"] is None else f"{r['mbu']:.1%}"
        ratio = "" if r["x_matmuls"] is None else f"{r['x_matmuls']:.2f}"
        launches = (f" {r['kernels']['launches_per_step']:.0f} |" if "kernels" in r
                    else " |") if counted else ""
        print(f"| {r['way']} | {r['step_ms']:.3f} | {ratio} | {mbu} | {r['set_up_s']:.1f} |"
              + launches)
    Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
