"""What log-probabilities, penalties and sampling filters add to one decode step (issue 46):
the captured decode step of --rows rows at --kv keys each, timed for each variant of what the
step computes beside the greedy pick.

    python3 benchmarks/bench_step_extras.py [--layout 134M] [--rows 64] [--kv 256]
        [--steps 32] [--repeats 7] [--json FILE] [--smoke]

Model: graphrun's builtin Llama in a Llama layout with seeded weights, bf16 on a GPU (134M:
12 x 768, 12 heads, ffn 2048, vocab 32000; 1.24B: 16 x 2048, 32 heads, 8 KV heads, ffn 8192,
vocab 128256). Per variant an Engine is built (graphs captured and verified as a job's are);
its decode graph of --rows rows is replayed from the same state (every row live, --kv keys in
blocks of its own) --steps times between CUDA events, --repeats times; the median step time is
printed with its extra over the plain greedy step, and the all-on step's over sample+min_p's.
--smoke: a 2-layer layout, fp32, on whatever device there is (eager on the CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_decode_step import LAYOUTS  # noqa: E402

# name -> (Engine variant keywords, per-row sampling written into every row)
VARIANTS = {
    "greedy": ({}, {}),
    "greedy + logprobs 5": ({"logprobs": 5}, {}),
    "greedy + logprobs 20": ({"logprobs": 20}, {}),
    "greedy + penalties": ({"penalized": True}, {"repetition": 1.1, "presence": 0.3,
                                                 "frequency": 0.2}),
    "sample": ({"sample": True}, {"temperature": 1.0}),
    "sample + min_p": ({"sample": True, "filtered": True}, {"temperature": 1.0, "min_p": 0.05}),
    "all (Batch job)": ({"sample": True, "filtered": True, "penalized": True, "logprobs": 20},
                        {"temperature": 1.0, "min_p": 0.05, "repetition": 1.1,
                         "presence": 0.3, "frequency": 0.2}),
}


def fill(state, rows: int, kv: int, steps: int, vocab: int, per_row: dict) -> None:
    """Every one of the first `rows` slots live at `kv` keys, in blocks of its own."""
    gen = torch.Generator().manual_seed(0)
    per = -(-(kv + steps) // state.block_size)  # the keys the timed steps add too
    table = torch.zeros_like(state.block_table)
    for r in range(rows):
        table[r, :per] = 1 + r * per + torch.arange(per)
    state.block_table.copy_(table)
    state.seq_lens[:rows].fill_(kv)
    state.token[:rows].copy_(torch.randint(0, vocab, (rows,), generator=gen))
    state.index[:rows].fill_(1)
    state.done[:rows].fill_(False)
    state.max_new.fill_(1 << 30)
    for name, value in per_row.items():
        getattr(state, name).fill_(value)


def time_variant(model, name: str, a, device: torch.device, dtype: torch.dtype) -> dict:
    from graphrun.generate.config import GenerateConfig
    from graphrun.generate.engine import build_engine
    from graphrun.generate.graphs import StepKey

    choices, per_row = VARIANTS[name]
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    eng = build_engine(model, GenerateConfig(max_new_tokens=a.steps + 1), slots=a.rows,
                       max_prompt=a.kv, device=device, dtype=dtype, rows=[a.rows],
                       prompts=[a.kv], **choices)
    setup = time.perf_counter() - t0
    entry = eng.table[StepKey("decode", a.rows)]
    fill(eng.state, a.rows, a.kv, a.steps, eng.model.vocab, per_row)
    start = eng.state.snapshot()
    times = []
    with torch.no_grad():
        for _ in range(a.repeats):
            eng.state.restore(start)
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                begin.record()
            t = time.perf_counter()
            for _ in range(a.steps):
                entry.run()
            if cuda:
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end) / 1e3 / a.steps)
            else:
                times.append((time.perf_counter() - t) / a.steps)
    out = {"step_ms": statistics.median(times) * 1e3, "status": entry.status,
           "setup_s": setup}
    eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="134M", choices=sorted(LAYOUTS))
    for name, default in (("rows", 64), ("kv", 256), ("steps", 32), ("repeats", 7)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    from graphrun.models.causal.llama import build_llama

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and not a.smoke else torch.float32
    if a.smoke:
        a.layout, a.rows, a.kv, a.steps, a.repeats = "tiny", 4, 16, 2, 2
    model = build_llama(**LAYOUTS[a.layout], max_len=a.kv + a.steps + 2, device=device,
                        dtype=dtype)
    rows = {}
    for name in a.variants.split(","):
        rows[name] = time_variant(model, name, a, device, dtype)
    base = rows.get("greedy", {}).get("step_ms")
    filtered = rows.get("sample + min_p", {}).get("step_ms")
    print(f"{'variant':24} {'step ms':>9} {'vs greedy':>10} {'status':>9}")
    for name, r in rows.items():
        extra = f"{(r['step_ms'] / base - 1) * 100:+.1f}%" if base else "-"
        print(f"{name:24} {r['step_ms']:9.3f} {extra:>10} {r['status']:>9}")
    if filtered and "all (Batch job)" in rows:
        print(f"all on vs sample + min_p: "
              f"{(rows['all (Batch job)']['step_ms'] / filtered - 1) * 100:+.1f}%")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {gpu}, layout {a.layout}, rows {a.rows}, kv {a.kv}, "
          f"{dtype}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
