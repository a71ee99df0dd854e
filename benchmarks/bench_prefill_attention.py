"""A packed prefill's attention two ways, on one GPU: the masked one (scaled_dot_product_attention
over the packed tokens under a block-diagonal causal mask, models/causal/kv_cache.fresh_attend,
what runs where the flash kernel does not) and the flash kernel over the prompts' boundaries
(models/causal/packed_attention.attend, what a bf16 prefill runs). Each way in a process of its
own, per packed size, largest first: the first call (what a graph's set-up pays), the steady
time (median of 30, CUDA events) and the two outputs' difference. The boundaries are laid out as
the engine lays them out: 256 slots' worth of entries, the pack's end repeated.

    python3 benchmarks/bench_prefill_attention.py [--layouts 134M,1.24B,8B] [--prompt 51]
        [--sizes 64,128,256,512,1024,2048]

H200 budget: about 40 seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SLOTS = 256


def heads_of(layout: str) -> tuple[int, int, int]:
    """(heads, kv heads, head dim) of one of bench_decode_step.py's layouts."""
    from benchmarks.bench_decode_step import LAYOUTS

    s = LAYOUTS[layout]
    return s["heads"], s["kv_heads"], s["d_model"] // s["heads"]


def inputs(n: int, prompt: int, heads: int, kv: int, d: int, torch):
    gen = torch.Generator("cuda").manual_seed(n)
    q = torch.randn(n, heads, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, kv, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, kv, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    cuts = list(range(0, n, prompt)) + [n]
    cu = torch.tensor(cuts, dtype=torch.int32, device="cuda")
    # as the engine fills it: SLOTS + 2 entries, the pack's end repeated
    starts = torch.full((SLOTS + 2,), n, dtype=torch.int32, device="cuda")
    starts[:len(cuts)] = cu
    seg = torch.repeat_interleave(torch.arange(len(cuts) - 1, device="cuda"),
                                  (cu[1:] - cu[:-1]).long())
    mask = (seg[:, None] == seg[None, :]) & torch.ones(n, n, dtype=torch.bool,
                                                        device="cuda").tril()
    return q, k, v, starts, mask[None, None]


def one_way(way: str, layout: str, sizes: list[int], prompt: int) -> dict:
    import torch

    from graphrun.models.causal import packed_attention
    from graphrun.models.causal.kv_cache import fresh_attend

    heads, kv, d = heads_of(layout)
    scale = d ** -0.5

    def call(q, k, v, cu, mask):
        if way == "masked":
            return fresh_attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                v.transpose(0, 1)[None], mask, scale)[0]
        return packed_attention.attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], cu, scale)[0]

    torch.cuda.init()
    rows = {}
    for n in sorted(sizes, reverse=True):  # largest first, as the graphs are set up
        args = inputs(n, prompt, heads, kv, d, torch)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = call(*args)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        for _ in range(5):
            call(*args)
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        times = []
        for _ in range(30):
            start.record()
            call(*args)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        rows[n] = {"first_ms": first * 1e3, "us": sorted(times)[len(times) // 2],
                   "out": out.float().cpu().tolist() if n <= 64 else None,
                   "sum": float(out.float().abs().sum())}
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", default="134M,1.24B,8B")
    p.add_argument("--sizes", default="64,128,256,512,1024,2048")
    p.add_argument("--prompt", type=int, default=51)
    p.add_argument("--child", nargs=2)
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.child:
        print(json.dumps(one_way(a.child[0], a.child[1], sizes, a.prompt)))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_prefill_attention: needs a CUDA GPU (both ways time GPU kernels)")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, prompts of {a.prompt} "
          "tokens packed, bf16")
    for layout in a.layouts.split(","):
        got = {}
        for way in ("flash", "masked"):
            r = subprocess.run([sys.executable, __file__, "--child", way, layout, "--sizes",
                                a.sizes, "--prompt", str(a.prompt)], capture_output=True,
                               text=True)
            if r.returncode:
                print(f"{layout} {way}: failed\n{r.stderr[-2000:]}")
                got[way] = None
                continue
            got[way] = {int(k): v for k, v in json.loads(r.stdout.splitlines()[-1]).items()}
        print(f"\n{layout} (heads, kv heads, d = {heads_of(layout)})")
        print("| tokens | masked first ms | flash first ms | masked us | flash us | "
              "outputs' abs sums |")
        print("|---:|---:|---:|---:|---:|---|")
        for n in sorted(sizes):
            m, v = (got[w][n] if got[w] else None for w in ("masked", "flash"))
            cell = (lambda r, key, f: f.format(r[key]) if r else "-")
            diff = "-"
            if m and v and m["out"] is not None:
                mo, vo = torch.tensor(m["out"]), torch.tensor(v["out"])
                diff = f"max diff {float((mo - vo).abs().max()):.3g}"
            elif m and v:
                diff = f"{m['sum']:.1f} / {v['sum']:.1f}"
            print(f"| {n} | {cell(m, 'first_ms', '{:.1f}')} | {cell(v, 'first_ms', '{:.1f}')} "
                  f"| {cell(m, 'us', '{:.1f}')} | {cell(v, 'us', '{:.1f}')} | {diff} |")


if __name__ == "__main__":
    main()
