"""Shared prefixes computed once (issue 47): one job of --prompts prompts that all start with
the same --system tokens, then a user part of --user-min to --user-max tokens, through
generate/engine.py with the prefix cache on and off, in one run.

    python3 benchmarks/bench_prefix.py [--layers 16 --d-model 2048 --heads 32 --kv-heads 8
        --vocab 32000 --ffn 8192] [--prompts 2048] [--system 1000] [--user-min 20]
        [--user-max 200] [--new-tokens 64] [--slots 256] [--prefill-tokens 4096] [--json FILE]

The model is graphrun's builtin Llama built from those sizes with seeded weights (bf16 on a GPU,
fp32 on the CPU); every record samples (seeded) all --new-tokens tokens, so both jobs do the
same decode work. Printed per job: prompt tokens computed (prefilled) and reused (shared from
the cache), computed / unique prompt tokens (the system prompt once plus every user part),
graph set-up, the wall time of the whole generate call, prefill and decode device time,
prefills (and those that read cached blocks, run eagerly), output tokens/s; then the speed-up of the whole call and how many records' tokens
are equal between the two jobs.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from graphrun.generate.config import GenerateConfig, Sampling
from graphrun.generate.engine import build_engine
from graphrun.models.causal.llama import build_llama


def prompts_of(n: int, system: int, low: int, high: int, vocab: int,
               seed: int = 0) -> tuple[list[list[int]], int]:
    """The prompts and their unique tokens (the system prompt counted once)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, size=system).tolist()
    users = [rng.integers(3, vocab, size=int(k)).tolist()
             for k in rng.integers(low, high + 1, size=n)]
    return [shared + u for u in users], system + sum(map(len, users))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def job(model, prompts, *, on: bool, device, dtype, slots: int, new: int,
        prefill_tokens: int) -> tuple[dict, list[list[int]]]:
    config = GenerateConfig(max_new_tokens=new,
                            sampling=Sampling(method="sample", temperature=1.0, seed=0))
    sync(device)
    t0 = time.perf_counter()
    eng = build_engine(model, config, slots=slots, max_prompt=max(map(len, prompts)),
                       device=device, dtype=dtype, prefill_tokens=prefill_tokens,
                       prefix_cache=on)
    sync(device)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    done = eng.generate(prompts, list(range(len(prompts))))
    sync(device)
    wall = time.perf_counter() - t0
    s = eng.stats
    out = {"prompt_tokens_computed": s.prompt_computed, "prompt_tokens_reused": s.prompt_reused,
           "graph_setup_s": setup, "generate_wall_s": wall, "prefill_s": s.prefill_s,
           "decode_s": s.decode_s, "prefills": s.prefills,
           "reading_prefills": s.reading_prefills, "decode_steps": s.decode_steps,
           "output_tokens": s.output_tokens,
           "generate_tokens_per_s": s.output_tokens / (s.prefill_s + s.decode_s),
           "kv_blocks_peak": s.kv_blocks_peak, "kv_blocks": eng.num_blocks}
    eng.close()
    return out, [c.token_ids for c in done]


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("layers", 16), ("d-model", 2048), ("heads", 32), ("kv-heads", 8),
                          ("vocab", 32000), ("ffn", 8192), ("prompts", 2048), ("system", 1000),
                          ("user-min", 20), ("user-max", 200), ("new-tokens", 64),
                          ("slots", 256), ("prefill-tokens", 4096)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json")
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    longest = a.system + a.user_max
    model = build_llama(layers=a.layers, d_model=a.d_model, heads=a.heads, kv_heads=a.kv_heads,
                        vocab=a.vocab, ffn=a.ffn, max_len=longest + a.new_tokens,
                        device=device, dtype=dtype)
    prompts, unique = prompts_of(a.prompts, a.system, a.user_min, a.user_max, a.vocab)
    rows, outputs = {}, {}
    for name, on in (("sharing on", True), ("sharing off", False)):
        rows[name], outputs[name] = job(model, prompts, on=on, device=device, dtype=dtype,
                                        slots=a.slots, new=a.new_tokens,
                                        prefill_tokens=a.prefill_tokens)
        r = rows[name]
        r["computed_per_unique"] = r["prompt_tokens_computed"] / unique
        print(name, json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                for k, v in r.items()}), flush=True)
    on, off = rows["sharing on"], rows["sharing off"]
    equal = sum(x == y for x, y in zip(outputs["sharing on"], outputs["sharing off"]))
    print(f"prompt tokens: {sum(map(len, prompts)):,} in all, {unique:,} unique; computed "
          f"{on['prompt_tokens_computed']:,} with sharing ({on['computed_per_unique']:.3f}x "
          f"unique), {off['prompt_tokens_computed']:,} without")
    print(f"whole generate call: {on['generate_wall_s']:.2f} s with sharing, "
          f"{off['generate_wall_s']:.2f} s without: {off['generate_wall_s'] / on['generate_wall_s']:.2f}x; "
          f"records with equal tokens: {equal} of {len(prompts)}")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}, {dtype}, prompts {a.prompts}, system {a.system}, "
          f"user parts {a.user_min}-{a.user_max}, slots {a.slots}, new tokens {a.new_tokens}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
