"""The paged decode-attention kernel's launch (paged_attention.KernelConfig: tile, warps, pipeline
stages, programs and shares) swept on a GPU over decode layouts; each config checked against the
reference attention, timed, and the winner printed to set as the default.

    python3 benchmarks/tune_paged_decode.py [--rows 256] [--kv-len 160,512] [--heads 32]
        [--kv-heads 8] [--head-dim 128] [--block-size 16] [--dtype bfloat16]
        [--tiles 16,32,64,128] [--warps 1,2,4,8] [--stages 1,2,3,4] [--programs 128,4096]
        [--max-splits 16] [--calls 20] [--replays 20] [--json FILE]

A case is (rows, KV length): every row that long, its blocks scattered through one layer's
cache, its table as wide as a decode graph's (the length and 33 more tokens, as
bench_decode_step's engine sizes it), q, k and v strided as the model leaves them. The defaults
are the 8B Llama layout's attention (32 query heads, 8 KV heads, head_dim 128) at 256 rows;
programs 4096 splits each of its 2048 (row, KV head) pairs' keys in two shares, merged.

Per config and case: one call checked against paged_decode_reference in float32 (output and the
new key's slot); a config that fails to compile or differs is reported and left out. Then
--calls calls captured in one CUDA graph, the median over --replays replays per call (us), the
keys and values read per second, and their share of the GPU's peak bandwidth. A config's
score is the geometric mean over the cases of its time / the default config's; the least wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphrun.models.causal import paged_attention  # noqa: E402
from graphrun.models.causal.paged_attention import KernelConfig  # noqa: E402

SLACK = 33  # tokens past the KV length a row's table holds: bench_decode_step's steps + 1
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def make_case(rows: int, kv_len: int, heads: int, kv_heads: int, dim: int, block_size: int,
              dtype: torch.dtype, device, seed: int = 0) -> dict:
    """One decode step's arguments of paged_decode (its `scale` included)."""
    gen = torch.Generator().manual_seed(seed)
    per_row = -(-(kv_len + SLACK) // block_size)
    num_blocks = 1 + rows * per_row  # block 0: no row's (the engine's padding block)
    blocks = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = blocks.view(rows, per_row).to(torch.int32)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device,
                                                                        dtype=dtype)

    qk = rand(rows, 1, heads + kv_heads, dim).transpose(1, 2)  # as RoPE's output leaves them
    return dict(q=qk[:, :heads], k_new=qk[:, heads:],
                v_new=rand(rows, 1, kv_heads, dim).transpose(1, 2),
                k_cache=rand(num_blocks, kv_heads, block_size, dim),
                v_cache=rand(num_blocks, kv_heads, block_size, dim),
                block_table=table.to(device),
                seq_lens=torch.full((rows,), kv_len, dtype=torch.int32, device=device),
                scale=dim ** -0.5)


def reference(case: dict) -> tuple[torch.Tensor, dict]:
    """(paged_decode_reference's output, the case after its write), in float32 copies."""
    wide = {n: t.to(torch.float32, copy=True)
            if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for n, t in case.items()}
    return paged_attention.paged_decode_reference(**wide), wide


def check(case: dict, run, want: tuple[torch.Tensor, dict] | None = None) -> str | None:
    """None when run(case) -> output equals the reference's (`want`, else computed) within
    the dtype's tolerance and leaves every row's new key and value in its slot; else what
    differs. run gets copies of the caches, so the case is never changed."""
    mine = {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
    want, wide = want or reference(case)
    got = run(mine)
    if got.shape != want.shape:
        return f"output shape {tuple(got.shape)}, the reference's {tuple(want.shape)}"
    if not torch.isfinite(got).all():
        return "output not finite"
    err = (got.float() - want).abs().max().item()
    tol = TOLERANCE[case["q"].dtype]
    if err > tol:
        return f"output differs from the reference by {err:.3g} (> {tol})"
    for name in ("k_cache", "v_cache"):
        if not torch.equal(mine[name].float(), wide[name]):
            return f"{name} differs from the reference's after the step's write"
    return None


def kernel(config: KernelConfig):
    """A run for check and timing: the Triton kernel launched with config."""
    return lambda case: paged_attention._kernel_decode(**case, config=config)


def timed(fn, calls: int, replays: int) -> float:
    """Median microseconds per call of `calls` calls of fn captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    del graph
    return statistics.median(times)


def configs(a) -> list[KernelConfig]:
    """The default first, then every combination of the values given (invalid ones left out)."""
    out = [KernelConfig()]
    for tile, warps, stages, programs, splits in itertools.product(
            a.tiles, a.warps, a.stages, a.programs, a.max_splits):
        try:
            c = KernelConfig(tile=tile, warps=warps, stages=stages, programs=programs,
                             max_splits=splits)
        except ValueError as err:
            print(f"# left out: {err}")
            continue
        if c not in out:
            out.append(c)
    return out


def label(c: KernelConfig) -> str:
    return f"{c.tile} | {c.warps} | {c.stages} | {c.programs} | {c.max_splits}"


def ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers of 1 or more, "
                                         "comma-separated")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=ints, default=[256])
    ap.add_argument("--kv-len", type=ints, default=[160, 512])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--tiles", type=ints, default=[16, 32, 64, 128])
    ap.add_argument("--warps", type=ints, default=[1, 2, 4, 8])
    ap.add_argument("--stages", type=ints, default=[1, 2, 3, 4])
    ap.add_argument("--programs", type=ints, default=sorted({KernelConfig().programs, 4096}))
    ap.add_argument("--max-splits", type=ints, default=[KernelConfig().max_splits])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json", default=str(Path(os.environ.get("OUT", ".")) /
                                          "tune_paged_decode.json"))
    a = ap.parse_args(argv)
    if a.heads % a.kv_heads:
        ap.error(f"--heads {a.heads} must be a multiple of --kv-heads {a.kv_heads}")
    if not torch.cuda.is_available():
        print("tune_paged_decode: needs a CUDA GPU (the kernel is Triton's)", file=sys.stderr)
        return 2
    from graphrun.generate.mbu import peak_bandwidth

    dtype = getattr(torch, a.dtype)
    name = torch.cuda.get_device_name()
    peak = peak_bandwidth(name)
    cases = [(r, n) for r in a.rows for n in a.kv_len]
    print(f"# tune_paged_decode: {name}, torch {torch.__version__}, {a.dtype}, heads {a.heads}, "
          f"kv_heads {a.kv_heads}, head_dim {a.head_dim}, block_size {a.block_size}; us per "
          f"call, median of {a.replays} replays of {a.calls} calls", flush=True)
    built = {rn: make_case(*rn, a.heads, a.kv_heads, a.head_dim, a.block_size, dtype, "cuda",
                           seed=i) for i, rn in enumerate(cases)}
    wants = {rn: reference(c) for rn, c in built.items()}
    nbytes = {rn: 2 * rn[0] * a.kv_heads * rn[1] * a.head_dim * dtype.itemsize for rn in cases}
    print("| tile | warps | stages | programs | max_splits | "
          + " | ".join(f"rows {r} kv {n} us (GB/s)" for r, n in cases) + " | x default |")
    print("|---:|---:|---:|---:|---:|" + "---:|" * (len(cases) + 1), flush=True)
    results, base = [], None
    for c in configs(a):
        row = {"config": dataclasses.asdict(c), "us": {}, "error": None}
        run = kernel(c)
        try:
            for rn in cases:
                wrong = check(built[rn], run, wants[rn])
                if wrong:
                    raise AssertionError(f"rows {rn[0]} kv {rn[1]}: {wrong}")
                row["us"][f"{rn[0]}x{rn[1]}"] = timed(lambda: run(built[rn]), a.calls,
                                                      a.replays)
        except Exception as err:  # noqa: BLE001 - a config that cannot compile or is wrong
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            print(f"| {label(c)} | {row['error']} |", flush=True)
            results.append(row)
            continue
        us = [row["us"][f"{r}x{n}"] for r, n in cases]
        if base is None:  # the default comes first; where it failed, the first that ran
            base = us
            if c != KernelConfig():
                print("# the default config failed: ratios are to this one", flush=True)
        row["x_default"] = math.exp(statistics.fmean(math.log(t / b) for t, b in zip(us, base)))
        cells = [f"{t:.1f} ({nbytes[rn] / t / 1e3:.0f})" for t, rn in zip(us, cases)]
        print(f"| {label(c)} | " + " | ".join(cells) + f" | {row['x_default']:.3f} |",
              flush=True)
        results.append(row)
    good = [r for r in results if r["error"] is None]
    if not good:
        print("no config ran correctly", file=sys.stderr)
        return 1
    win = min(good, key=lambda r: r["x_default"])
    w = KernelConfig(**win["config"])
    print(f"\nwinner: {w} at {win['x_default']:.3f}x the default's time")
    for rn in cases:
        t = win["us"][f"{rn[0]}x{rn[1]}"]
        share = f", {nbytes[rn] / (t * 1e-6) / peak:.0%} of peak bandwidth" if peak else ""
        print(f"   rows {rn[0]} kv {rn[1]}: {t:.1f} us a layer{share}")
    Path(a.json).write_text(json.dumps({"device": name, "cases": cases, "results": results,
                                        "winner": win["config"]}, indent=1))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
