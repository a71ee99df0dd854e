"""The job of bench_continuous.py on the static-batching engine this change retired, for a
comparison in one run: run it with a tree of the commit before the engine on PYTHONPATH (e.g.
`git archive 9304e2d | tar -x -C /tmp/old; PYTHONPATH=/tmp/old python3
benchmarks/bench_static_baseline.py`). Batches of --slots consecutive prompts, buckets batch
[--slots] and seq [32, 64, 128, 256, 512], every graph set up before timing (the set-up column).
Prints the same fields as bench_continuous.py, from the retired Generator's BatchResults.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from graphrun.generate.config import GenerateConfig, Sampling
from graphrun.generate.generator import build_generator

try:  # the retired engine's tree kept its Llama in generate/
    from graphrun.generate.llama import build_llama
except ImportError:
    from graphrun.models.causal.llama import build_llama


def prompts_of(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """bench_continuous.py's prompts (the same seed gives the same ids)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.normal(np.log(51), 0.9, n)), 16, 512).astype(int)
    return [rng.integers(3, vocab, size=int(k)).tolist() for k in lengths]


def job(model, prompts, *, slots: int, new: int, stops: tuple) -> dict:
    config = GenerateConfig(max_new_tokens=new, eos_ids=stops,
                            sampling=Sampling(method="sample", temperature=1.0, seed=0))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gen = build_generator(model, config, batch_buckets=[slots],
                          prompt_buckets=[32, 64, 128, 256, 512], device="cuda",
                          dtype=torch.bfloat16, lazy=False)
    torch.cuda.synchronize()
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    results = [gen.generate(prompts[i:i + slots], list(range(i, i + len(prompts[i:i + slots]))))
               for i in range(0, len(prompts), slots)]
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out_tokens = sum(c.output_tokens for r in results for c in r.completions)
    busy = sum(r.prefill_s + r.decode_s for r in results)
    row_steps = sum(r.decode_steps * r.rows for r in results)
    useful = sum(r.useful_steps for r in results)
    out = {"graph_setup_s": setup, "graphs": len(gen.buckets()),
           "generate_tokens_per_s": out_tokens / busy, "wall_tokens_per_s": out_tokens / wall,
           "generate_wall_s": wall, "prefill_s": sum(r.prefill_s for r in results),
           "decode_s": sum(r.decode_s for r in results), "wasted": 1 - useful / row_steps,
           "decode_steps": sum(r.decode_steps for r in results),
           "mean_output_tokens": out_tokens / len(prompts)}
    gen.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("layers", 12), ("d-model", 768), ("heads", 12), ("kv-heads", 12),
                          ("vocab", 32000), ("ffn", 2048), ("prompts", 1024), ("slots", 64),
                          ("new-tokens", 128), ("stop-ids", 560)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--json")
    a = ap.parse_args()
    model = build_llama(layers=a.layers, d_model=a.d_model, heads=a.heads, kv_heads=a.kv_heads,
                        vocab=a.vocab, ffn=a.ffn, max_len=1024, device="cuda",
                        dtype=torch.bfloat16)
    prompts = prompts_of(a.prompts, a.vocab)
    rows = {}
    for name, ids in (("varied", tuple(range(1000, 1000 + a.stop_ids))), ("fixed", ())):
        rows[name] = job(model, prompts, slots=a.slots, new=a.new_tokens, stops=ids)
        print("static", name, json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                          for k, v in rows[name].items()}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
