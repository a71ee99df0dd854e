"""The continuous-batching engine on one GPU (issue 48): a job of --prompts prompts of 16-512
tokens through generate/engine.py, sampled and seeded, once ended by stop ids (a share of the
vocabulary chosen so completions average about 45 of the 128 cap) and once with every record
generating all 128.

    python3 benchmarks/bench_continuous.py [--layout 134M] [--prompts 1024] [--slots 64|auto]
        [--new-tokens 128] [--stop-ids N] [--prefill-tokens 2048] [--admit-min 1,4]
        [--decode-sizes "1,2,4,8;8,16,32"] [--json FILE] [--smoke]
    python3 benchmarks/bench_continuous.py --layout 8B --slots 256 --prompts 2048

The model is graphrun's builtin Llama in one of bench_decode_step.py's layouts (134M, 1.24B,
8B, tiny; --layers, --d-model, --heads, --kv-heads, --vocab, --ffn change one size) with seeded
weights, built on the device in bf16 (timing does not depend on the weights). --stop-ids: how
many ids end a completion (default 560 per 32,000 of the vocabulary). --slots auto: the
engine's own choice from the memory left after the weights (engine.auto_slots). Printed per
job: graph set-up (the engine's construction: cache, buffers, warm-up, capture and
verification of every graph), generate tokens/s (output tokens / (prefill + decode device
time), the manifest's output_tokens_per_s), the wall time of the whole generate call, decode
row-steps wasted, slot occupancy, KV blocks (mean, peak), decode steps, prefills, mean output
tokens; then a table of them.
--smoke: the tiny layout on whatever device there is (float32 on the CPU), 24 prompts, 16 new
tokens, 8 slots: a check of the plumbing.
H200 budget: the 134M or 1.24B layout at 64 slots under a minute; 8B at 256 slots and 2,048
prompts about 2 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_decode_step import LAYOUTS  # noqa: E402
from graphrun.generate.config import GenerateConfig, Sampling  # noqa: E402
from graphrun.generate.engine import build_engine  # noqa: E402
from graphrun.models.causal.llama import build_llama  # noqa: E402

STOPS_PER_32K = 560  # stop ids per 32,000 of the vocabulary: completions average about 45 of 128


def prompts_of(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.normal(np.log(51), 0.9, n)), 16, 512).astype(int)
    return [rng.integers(3, vocab, size=int(k)).tolist() for k in lengths]


def stop_ids(vocab: int, count: int | None = None) -> tuple[int, ...]:
    """The varied job's stop ids: `count` (default: STOPS_PER_32K scaled to the vocabulary)
    consecutive ids from 1000, or from the vocabulary's end where it is small."""
    count = count if count is not None else max(1, round(STOPS_PER_32K * vocab / 32000))
    first = min(1000, vocab - count)
    return tuple(range(first, first + count))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def job(model, prompts, *, slots: int | str, new: int, stops: tuple, prefill_tokens: int,
        device: torch.device, dtype: torch.dtype, admit_min: int | None = None,
        rows: list[int] | None = None) -> dict:
    config = GenerateConfig(max_new_tokens=new, eos_ids=stops,
                            sampling=Sampling(method="sample", temperature=1.0, seed=0))
    sync(device)
    t0 = time.perf_counter()
    eng = build_engine(model, config, slots=slots, max_prompt=512, device=device,
                       dtype=dtype, prefill_tokens=prefill_tokens, admit_min=admit_min,
                       rows=rows)
    sync(device)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    done = eng.generate(prompts, list(range(len(prompts))))
    sync(device)
    wall = time.perf_counter() - t0
    s = eng.stats
    out = {"slots": eng.slots, "decode_sizes": eng.decode_sizes, "graph_setup_s": setup,
           "graphs": len(eng.graphs()),
           "captured": sum(g["status"] == "captured" for g in eng.graphs()),
           "generate_tokens_per_s": s.output_tokens / (s.prefill_s + s.decode_s),
           "wall_tokens_per_s": s.output_tokens / wall, "generate_wall_s": wall,
           "prefill_s": s.prefill_s, "decode_s": s.decode_s,
           "wasted": 1 - s.useful_steps / max(1, s.decode_row_steps),
           "occupancy": s.occupied_row_steps / max(1, s.decode_steps * eng.slots),
           "kv_blocks_mean": s.kv_block_steps / max(1, s.decode_steps),
           "kv_blocks_peak": s.kv_blocks_peak, "kv_blocks": eng.num_blocks,
           "decode_steps": s.decode_steps, "prefills": s.prefills,
           "reading_prefills": s.reading_prefills, "host_bound_steps": s.host_bound_steps,
           "mean_output_tokens": float(np.mean([c.output_tokens for c in done])),
           "output_tokens": s.output_tokens}
    eng.close()
    return out


def print_table(rows: dict) -> None:
    print("\n| job | slots | graph set-up s | graphs (captured) | generate tokens/s | "
          "generate call s | prefill s | decode s | wasted | occupancy | KV blocks mean / peak "
          "/ pool | decode steps | prefills | mean output tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['slots']} | {r['graph_setup_s']:.2f} | {r['graphs']} "
              f"({r['captured']}) | {r['generate_tokens_per_s']:,.0f} | "
              f"{r['generate_wall_s']:.2f} | {r['prefill_s']:.2f} | {r['decode_s']:.2f} | "
              f"{r['wasted']:.1%} | {r['occupancy']:.1%} | {r['kv_blocks_mean']:,.0f} / "
              f"{r['kv_blocks_peak']:,} / {r['kv_blocks']:,} | {r['decode_steps']:,} | "
              f"{r['prefills']:,} | {r['mean_output_tokens']:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="134M", choices=sorted(LAYOUTS))
    for name in ("layers", "d-model", "heads", "kv-heads", "vocab", "ffn"):
        ap.add_argument(f"--{name}", type=int, default=None, help="default: the layout's")
    for name, default in (("prompts", 1024), ("new-tokens", 128), ("prefill-tokens", 2048)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--slots", default="64", help="a number, or auto (the engine's choice)")
    ap.add_argument("--stop-ids", type=int, default=None,
                    help=f"default: {STOPS_PER_32K} per 32,000 of the vocabulary")
    ap.add_argument("--admit-min", default="",
                    help="comma-separated: the varied job again at each (free slots that "
                    "start a prefill)")
    ap.add_argument("--decode-sizes", default="",
                    help="';'-separated lists of decode row counts: both jobs again at each")
    ap.add_argument("--json", default=str(Path(os.environ.get("OUT", ".")) /
                                          "bench_continuous.json"))
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.layout, a.prompts, a.new_tokens, a.slots = "tiny", 24, 16, "8"
    sizes = {**LAYOUTS[a.layout], **{k: v for k in LAYOUTS[a.layout]
                                     if (v := getattr(a, k)) is not None}}
    slots = a.slots if a.slots == "auto" else int(a.slots)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = build_llama(**sizes, max_len=1024, device=device, dtype=dtype)
    sync(device)
    print(f"model {a.layout} {sizes} built on {device} in {time.perf_counter() - t0:.1f} s",
          flush=True)
    prompts = prompts_of(a.prompts, sizes["vocab"])
    stops = stop_ids(sizes["vocab"], a.stop_ids)
    rows = {}
    for name, ids in (("varied", stops), ("fixed", ())):
        rows[name] = job(model, prompts, slots=slots, new=a.new_tokens, stops=ids,
                         prefill_tokens=a.prefill_tokens, device=device, dtype=dtype)
        print(name, json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                for k, v in rows[name].items()}), flush=True)
    for n in filter(None, a.admit_min.split(",")):
        rows[f"varied, admit_min {n}"] = got = job(
            model, prompts, slots=slots, new=a.new_tokens, stops=stops,
            prefill_tokens=a.prefill_tokens, device=device, dtype=dtype, admit_min=int(n))
        print(f"varied admit_min={n}", json.dumps({k: round(v, 4) if isinstance(v, float)
                                                   else v for k, v in got.items()}), flush=True)
    for listed in filter(None, (x.strip() for x in a.decode_sizes.split(";"))):
        sizes_given = [int(v) for v in listed.split(",")]
        for name, ids in (("varied", stops), ("fixed", ())):
            key = f"{name}, decode sizes {listed}"
            rows[key] = got = job(model, prompts, slots=slots, new=a.new_tokens, stops=ids,
                                  prefill_tokens=a.prefill_tokens, device=device, dtype=dtype,
                                  rows=sizes_given)
            print(key, json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                   for k, v in got.items()}), flush=True)
    print_table(rows)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}, {dtype}, layout {a.layout}, prompts {a.prompts} "
          f"(median {int(np.median([len(p) for p in prompts]))} tokens), slots {a.slots}, "
          f"{len(stops)} stop ids (varied), {a.new_tokens} new at most")
    with open(a.json, "w") as f:
        json.dump({"args": vars(a), "sizes": sizes, "torch": torch.__version__, "device": name,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
