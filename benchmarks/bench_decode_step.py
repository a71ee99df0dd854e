"""One decode step of graphrun's generator, timed and taken apart: step time, MBU, and (on a
GPU, --profile) the kernels a captured step runs, for the plain model and model.compile, with
the decode-attention kernel or the general attention path (issue 33's MBU stretch).

    python3 benchmarks/bench_decode_step.py [--layout 1.24B] [--batch 1] [--prompt 128]
        [--new 128] [--ways plain,plain-general,compile,compile-general] [--profile]
        [--top 16] [--json FILE] [--smoke]

Model: graphrun's builtin Llama in a Llama layout with seeded weights, built on the device
(nothing is downloaded or saved): 134M (12 x 768, 12 heads, ffn 2048, vocab 32000) or 1.24B
(16 x 2048, 32 heads, 8 KV heads, ffn 8192, vocab 128256). The Generator API on one batch
bucket and one prompt bucket (the prompt length): one prefill graph and the decode graphs of
that prompt's KV lengths, captured and verified as a job's are.

Ways: plain (the model as a job runs it), compile (model.compile: true), and either with
`-general`: kv_cache's general attention path (scatter, then scaled_dot_product_attention)
instead of the decode-attention kernel.

Per way: the first batch with set-up (graphs captured, and compiled for compile); then 5
batches, step time = each batch's decode time (CUDA events) / its decode steps, the median
printed; MBU = the weights a step reads (generate/mbu.weight_bytes_per_step) / step time /
the GPU's peak bandwidth (the KV cache's bytes left out: at batch 1 and these lengths they are
under 1% of the weights'). --profile: torch.profiler over one more batch of graph replays,
the kernels per decode step with their device time, the largest --top.
--smoke: a 2-layer layout on whatever device there is, 8 new tokens, plain ways only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {
    "134M": dict(layers=12, d_model=768, heads=12, kv_heads=12, ffn=2048, vocab=32000),
    "1.24B": dict(layers=16, d_model=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256),
    "tiny": dict(layers=2, d_model=64, heads=4, kv_heads=2, ffn=128, vocab=512),
}
WAYS = ("plain", "plain-general", "compile", "compile-general")
TIMED_BATCHES = 5


def run_way(way: str, layout: str, batch: int, prompt: int, new: int, device: torch.device,
            profile: bool, top: int) -> dict:
    from graphrun.generate import decode_attention, kv_cache
    from graphrun.generate.config import GenerateConfig
    from graphrun.generate.generator import build_generator
    from graphrun.generate.llama import build_llama
    from graphrun.generate.mbu import peak_bandwidth, weight_bytes_per_step

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    general = way.endswith("-general")
    kv_cache.usable = (lambda q: False) if general else decode_attention.usable
    model = build_llama(**LAYOUTS[layout], max_len=prompt + new, seed=0, device=device,
                        dtype=dtype)
    weights = weight_bytes_per_step(model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, LAYOUTS[layout]["vocab"] - 1, (prompt,), generator=gen).tolist()
               for _ in range(batch)]
    ids = list(range(batch))
    t0 = time.perf_counter()
    g = build_generator(model, GenerateConfig(max_new_tokens=new), batch_buckets=[batch],
                        prompt_buckets=[prompt], device=device, dtype=dtype,
                        compile=way.startswith("compile"))
    first = g.generate(prompts, ids)
    set_up_s = time.perf_counter() - t0
    steps = []
    for _ in range(TIMED_BATCHES):
        r = g.generate(prompts, ids)
        steps.append(r.decode_s / max(1, r.decode_steps))
    step = statistics.median(steps)
    peak = peak_bandwidth(torch.cuda.get_device_name(device)) if cuda else None
    row = {"way": way, "layout": layout, "batch": batch, "prompt": prompt, "new": new,
           "set_up_s": set_up_s, "step_ms": step * 1e3, "step_min_ms": min(steps) * 1e3,
           "weight_bytes": weights, "mbu": weights / step / peak if peak else None,
           "same_tokens": [c.token_ids for c in r.completions] == [
               c.token_ids for c in first.completions],
           "graphs": [{k: e[k] for k in ("kind", "shape", "status", "compiled", "reason")}
                      for e in g.buckets()],
           "attention_failure": decode_attention.failure()}
    if profile and cuda:
        row["kernels"] = kernel_table(g, prompts, ids, top)
    g.close()
    kv_cache.usable = decode_attention.usable
    return row


def kernel_table(g, prompts, ids, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = g.generate(prompts, ids)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    per = r.decode_steps + 1  # the prefill's kernels are spread over the steps too
    rows = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    return {"launches_per_step": sum(e.count for e in kernels) / per,
            "device_us_per_step": sum(e.self_device_time_total for e in kernels) / per,
            "top": [{"name": e.key[:120], "us_per_step": e.self_device_time_total / per,
                     "calls_per_step": e.count / per} for e in rows]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="1.24B", choices=sorted(LAYOUTS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--json", default=str(Path(os.environ.get("OUT", ".")) /
                                          "bench_decode_step.json"))
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    ways = a.ways.split(",")
    if a.smoke:
        a.layout, a.new, a.prompt = "tiny", 8, 16
        ways = [w for w in ways if w.startswith("plain")]
    bad = [w for w in ways if w not in WAYS]
    if bad:
        ap.error(f"--ways: unknown {bad}; give some of {', '.join(WAYS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# bench_decode_step: {name}, torch {torch.__version__}, layout {a.layout}, "
          f"batch {a.batch}, prompt {a.prompt}, {a.new} new tokens", flush=True)
    rows = []
    for way in ways:
        row = run_way(way, a.layout, a.batch, a.prompt, a.new, device, a.profile, a.top)
        rows.append(row)
        mbu = "" if row["mbu"] is None else f"{row['mbu']:.1%}"
        print(f"\n## {way}: step p50 {row['step_ms']:.3f} ms (min {row['step_min_ms']:.3f}), "
              f"MBU {mbu or 'n/a'}, first batch with set-up {row['set_up_s']:.1f} s, "
              f"tokens equal across batches: {row['same_tokens']}", flush=True)
        for e in row["graphs"]:
            if e["reason"]:
                print(f"   {e['kind']} {e['shape']}: {e['reason']}")
        k = row.get("kernels")
        if k:
            print(f"   {k['launches_per_step']:.0f} kernels a step, "
                  f"{k['device_us_per_step']:.0f} us of device time a step")
            for e in k["top"]:
                print(f"   {e['us_per_step']:8.1f} us {e['calls_per_step']:5.1f}x  {e['name']}")
    print("\n| way | step p50 ms | MBU | first batch with set-up s |\n|---|---:|---:|---:|")
    for r in rows:
        mbu = "" if r["mbu"] is None else f"{r['mbu']:.1%}"
        print(f"| {r['way']} | {r['step_ms']:.3f} | {mbu} | {r['set_up_s']:.1f} |")
    Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
