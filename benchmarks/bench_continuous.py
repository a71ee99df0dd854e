"""The continuous-batching engine on one GPU (issue 48): a job of --prompts prompts of 16-512
tokens through generate/engine.py, sampled and seeded, once ended by stop ids (a share of the
vocabulary chosen so completions average about 45 of the 128 cap) and once with every record
generating all 128.

    python3 benchmarks/bench_continuous.py [--layers 12 --d-model 768 --heads 12 --kv-heads 12
        --vocab 32000 --ffn 2048] [--prompts 1024] [--slots 64] [--new-tokens 128]
        [--stop-ids 560] [--prefill-tokens 2048] [--json FILE]

The model is graphrun's builtin Llama built from those sizes with seeded weights in bf16 (timing
does not depend on the weights). Printed per job: graph set-up (the engine's construction: cache,
buffers, warm-up, capture and verification of every graph), generate tokens/s (output tokens /
(prefill + decode device time), the manifest's output_tokens_per_s), the wall time of the whole
generate call, decode row-steps wasted, slot occupancy, KV blocks (mean, peak), decode steps,
prefills (and those that read cached prompt blocks: none here, no two prompts share a block),
mean output tokens.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from graphrun.generate.config import GenerateConfig, Sampling
from graphrun.generate.engine import build_engine
from graphrun.generate.llama import build_llama


def prompts_of(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.normal(np.log(51), 0.9, n)), 16, 512).astype(int)
    return [rng.integers(3, vocab, size=int(k)).tolist() for k in lengths]


def job(model, prompts, *, slots: int, new: int, stops: tuple, prefill_tokens: int,
        admit_min: int | None = None) -> dict:
    config = GenerateConfig(max_new_tokens=new, eos_ids=stops,
                            sampling=Sampling(method="sample", temperature=1.0, seed=0))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng = build_engine(model, config, slots=slots, max_prompt=512, device="cuda",
                       dtype=torch.bfloat16, prefill_tokens=prefill_tokens,
                       admit_min=admit_min)
    torch.cuda.synchronize()
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    done = eng.generate(prompts, list(range(len(prompts))))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    s = eng.stats
    out = {"graph_setup_s": setup, "graphs": len(eng.graphs()),
           "captured": sum(g["status"] == "captured" for g in eng.graphs()),
           "generate_tokens_per_s": s.output_tokens / (s.prefill_s + s.decode_s),
           "wall_tokens_per_s": s.output_tokens / wall, "generate_wall_s": wall,
           "prefill_s": s.prefill_s, "decode_s": s.decode_s,
           "wasted": 1 - s.useful_steps / max(1, s.decode_row_steps),
           "occupancy": s.occupied_row_steps / max(1, s.decode_steps * slots),
           "kv_blocks_mean": s.kv_block_steps / max(1, s.decode_steps),
           "kv_blocks_peak": s.kv_blocks_peak, "kv_blocks": eng.num_blocks,
           "decode_steps": s.decode_steps, "prefills": s.prefills,
           "reading_prefills": s.reading_prefills, "host_bound_steps": s.host_bound_steps,
           "mean_output_tokens": float(np.mean([c.output_tokens for c in done])),
           "output_tokens": s.output_tokens}
    eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("layers", 12), ("d-model", 768), ("heads", 12), ("kv-heads", 12),
                          ("vocab", 32000), ("ffn", 2048), ("prompts", 1024), ("slots", 64),
                          ("new-tokens", 128), ("stop-ids", 560), ("prefill-tokens", 2048)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--admit-min", default="",
                    help="comma-separated: the varied job again at each (free slots that "
                    "start a prefill)")
    ap.add_argument("--json")
    a = ap.parse_args()
    model = build_llama(layers=a.layers, d_model=a.d_model, heads=a.heads, kv_heads=a.kv_heads,
                        vocab=a.vocab, ffn=a.ffn, max_len=1024, device="cuda",
                        dtype=torch.bfloat16)
    prompts = prompts_of(a.prompts, a.vocab)
    stops = tuple(range(1000, 1000 + a.stop_ids))
    rows = {}
    for name, ids in (("varied", stops), ("fixed", ())):
        rows[name] = job(model, prompts, slots=a.slots, new=a.new_tokens, stops=ids,
                         prefill_tokens=a.prefill_tokens)
        print(name, json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                for k, v in rows[name].items()}), flush=True)
    for n in filter(None, a.admit_min.split(",")):
        rows[f"varied, admit_min {n}"] = got = job(
            model, prompts, slots=a.slots, new=a.new_tokens, stops=stops,
            prefill_tokens=a.prefill_tokens, admit_min=int(n))
        print(f"varied admit_min={n}", json.dumps({k: round(v, 4) if isinstance(v, float)
                                                   else v for k, v in got.items()}), flush=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, prompts {a.prompts} "
          f"(median {int(np.median([len(p) for p in prompts]))} tokens), slots {a.slots}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
