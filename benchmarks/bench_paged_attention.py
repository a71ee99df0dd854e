"""The paged decode-attention kernel (models/causal/paged_attention.py) against the dense one it
succeeds (generate/decode_attention.py), one layer's decode attention, on a GPU.

    python3 benchmarks/bench_paged_attention.py [--rows 1,64,256] [--lengths 128,256,512,1024,2048]
        [--heads 32] [--kv-heads 8] [--dim 128] [--block-size 16] [--calls 20] [--replays 30]

Per (rows, length), every row at that length, bf16, the same keys in both layouts: dense, a
[rows, kv_heads, length, d] cache with an all-true mask; paged, a [blocks, kv_heads,
block_size, d] cache, each row's blocks shuffled through the pool, a table exactly as wide as
the length; and paged with a table as wide as the longest length (one graph serving every
length: the programs past a row's length return at once). Each way is `--calls` calls captured
in one CUDA graph; a replay is timed with CUDA events, the median of `--replays` replays over
`--calls` printed (microseconds per call), with the keys and values read per second. Before
timing, each paged output is checked against the dense one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, calls: int, replays: int) -> float:
    """Median microseconds per call of `calls` calls of fn replayed from one CUDA graph."""
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
    return statistics.median(times)


def build(rows: int, length: int, widest: int, args) -> dict:
    """The three ways' calls on one (rows, length), each checked against dense."""
    from graphrun.generate.decode_attention import decode_attend
    from graphrun.models.causal import paged_attention
    from graphrun.models.causal.paged_attention import paged_decode

    dev, dtype, bs = torch.device("cuda"), torch.bfloat16, args.block_size
    heads, kv_heads, dim = args.heads, args.kv_heads, args.dim
    gen = torch.Generator(device=dev).manual_seed(rows * 10000 + length)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=dtype)

    scale = dim ** -0.5
    q = rand(rows, 1, heads, dim).transpose(1, 2)
    k_new, v_new = (rand(rows, 1, kv_heads, dim).transpose(1, 2) for _ in range(2))
    dense_k, dense_v = rand(rows, kv_heads, length, dim), rand(rows, kv_heads, length, dim)
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool, device=dev)
    col = torch.full((rows,), length - 1, dtype=torch.int64, device=dev)
    per_row = length // bs
    # block 0 is the trash block; each row's blocks scattered through the pool
    blocks = (torch.randperm(rows * per_row, generator=gen, device=dev) + 1).view(rows, per_row)
    paged_k = torch.empty(1 + rows * per_row, kv_heads, bs, dim, dtype=dtype, device=dev)
    paged_v = torch.empty_like(paged_k)
    paged_k[blocks.flatten()] = dense_k.view(rows, kv_heads, per_row, bs, dim).transpose(1, 2) \
        .flatten(0, 1)
    paged_v[blocks.flatten()] = dense_v.view(rows, kv_heads, per_row, bs, dim).transpose(1, 2) \
        .flatten(0, 1)
    exact = blocks.int()
    wide = torch.zeros(rows, widest // bs, dtype=torch.int32, device=dev)
    wide[:, :per_row] = exact
    lens = torch.full((rows,), length, dtype=torch.int32, device=dev)
    want = decode_attend(dense_k, dense_v, q, k_new, v_new, mask, col, scale).float()

    def checked(table):
        def call():
            return paged_decode(q, k_new, v_new, paged_k, paged_v, table, lens, scale)

        err = (call().float() - want).abs().max().item()
        assert err < 2e-2, f"paged differs from dense at rows {rows}, length {length}: {err}"
        assert paged_attention.failure() is None, paged_attention.failure()
        return call

    return {"dense": lambda: decode_attend(dense_k, dense_v, q, k_new, v_new, mask, col, scale),
            "checked": checked, "exact": exact, "wide": wide,
            "kv_bytes": 2 * rows * kv_heads * length * dim * 2}


def case(rows: int, length: int, widest: int, args) -> dict:
    ways = build(rows, length, widest, args)
    us = {"dense": timed(ways["dense"], args.calls, args.replays),
          "paged": timed(ways["checked"](ways["exact"]), args.calls, args.replays),
          "paged_wide": timed(ways["checked"](ways["wide"]), args.calls, args.replays)}
    return {"rows": rows, "length": length, **us, "gbs": ways["kv_bytes"] / us["paged"] / 1e3}


def sweep(args) -> None:
    """The kernel's tile, warps and pipeline stages, on a few cases; the last line names the
    one whose worst ratio to dense is least."""
    import itertools

    from graphrun.models.causal import paged_attention as pa

    cases = [(1, 2048), (64, 1024), (256, 1024)]
    built = {c: build(*c, c[1], args) for c in cases}
    dense = {c: timed(built[c]["dense"], args.calls, args.replays) for c in cases}
    print("| tile | warps | stages | " + " | ".join(
        f"rows {r} len {n}: paged / dense ({dense[(r, n)]:.1f} us)" for r, n in cases) + " |")
    print("|---:|---:|---:|" + "---:|" * len(cases))
    best = (float("inf"), None)
    for tile, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
        pa.CONFIG = pa.KernelConfig(tile=tile, warps=warps, stages=stages)
        try:
            got = [timed(built[c]["checked"](built[c]["exact"]), args.calls, args.replays)
                   / dense[c] for c in cases]
        except Exception as err:  # noqa: BLE001 - a combination that cannot compile
            print(f"| {tile} | {warps} | {stages} | {str(err)[:80]} |")
            pa._failures.clear()
            continue
        print(f"| {tile} | {warps} | {stages} | "
              + " | ".join(f"{r:.2f}" for r in got) + " |", flush=True)
        best = min(best, (max(got), (tile, warps, stages)))
    tile, warps, stages = best[1]
    print(f"best: KernelConfig(tile={tile}, warps={warps}, stages={stages}) "
          "(benchmarks/tune_paged_decode.py sweeps every field on decode layouts)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,64,256")
    p.add_argument("--lengths", default="128,256,512,1024,2048")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--sweep", action="store_true",
                   help="time the kernel's tile, warps and stages instead")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_paged_attention: needs a CUDA GPU (the kernels are Triton's)")
    if args.sweep:
        sweep(args)
        return
    lengths = [int(n) for n in args.lengths.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, heads {args.heads}, "
          f"kv_heads {args.kv_heads}, d {args.dim}, block_size {args.block_size}; "
          f"us per call, median of {args.replays} replays of {args.calls} calls")
    print("| rows | length | dense us | paged us | paged / dense | paged, table for "
          f"{max(lengths)} us | its / dense | paged K+V GB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in (int(n) for n in args.rows.split(",")):
        for length in lengths:
            r = case(rows, length, max(lengths), args)
            print(f"| {rows} | {length} | {r['dense']:.1f} | {r['paged']:.1f} | "
                  f"{r['paged'] / r['dense']:.2f} | {r['paged_wide']:.1f} | "
                  f"{r['paged_wide'] / r['dense']:.2f} | {r['gbs']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
