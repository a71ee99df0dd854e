"""One host, several GPUs: the decoder step from an .npz on 1 GPU, then `--gpus 2`, then
`torchrun --nproc-per-node 2`; outputs checked equal to the 1-GPU run, rates printed.

    python3 benchmarks/bench_scale.py [--records 524288] [--batch 128] [--gpus 2]
        [--workdir DIR] [--out FILE] [--smoke]

The input: tokens [n, 1] and positions [n] (int64, seeded), stored uncompressed (np.savez),
so every worker memory-maps its share. The model: the builtin decoder, 12 layers x 768, 12
heads, vocab 32000, KV cache 512, bfloat16; buckets [1, 8, 32, BATCH]. Its outputs are the
top 8 next-token ids and logits, picked inside the captured step (64 bytes a record instead of
128 KB of logits: the disk would bound the rate, not the GPUs). Shards of 65,536 rows.

Per run, from a fresh `python -m graphrun run` process (import, CUDA start, capture included):
  wall s          the process's wall time
  records/s       the job's streaming rate: records out / the slowest worker's stream time
                  (manifest totals.records_per_s; setup and capture are not in it)
  per worker      each worker's own streaming rate (manifest workers[])
  speedup         records/s over the 1-GPU run's
  = 1 GPU         ids and values of every record against the 1-GPU run's: "bitwise" (the
                  shares start at whole batches, so every record runs in the same bucket and
                  slot), else the largest logit difference and the records whose top ids
                  differ, held to twice the spread between two 1-GPU processes (the run
                  "1 GPU, again": bf16 kernels chosen at capture may round one unit apart
                  from one process to the next); "NO: ..." fails the script
--smoke: a tiny float32 decoder on the CPU (device: cpu, 2 CPU worker processes), to check
the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]


def write_input(path: Path, n: int, vocab: int, max_len: int) -> None:
    rng = np.random.default_rng(7)
    np.savez(path, tokens=rng.integers(0, vocab, (n, 1), dtype=np.int64),
             positions=rng.integers(0, max_len, n, dtype=np.int64))


def write_spec(path: Path, data: Path, args) -> None:
    if args.smoke:
        model = {"layers": 2, "d_model": 64, "heads": 4, "vocab": 512, "max_len": 64}
        device, dtype = "cpu", "float32"
    else:
        model = {"layers": 12, "d_model": 768, "heads": 12, "vocab": 32000, "max_len": 512}
        device, dtype = "cuda", "bfloat16"
    spec = {
        "version": 1, "name": "bench-scale", "device": device,
        "model": {"builtin": "decoder", "args": model, "dtype": dtype},
        "inputs": {"tokens": {"shape": ["batch", 1], "dtype": "int64",
                              "range": [0, model["vocab"]]},
                   "positions": {"shape": ["batch"], "dtype": "int64",
                                 "range": [0, model["max_len"]]}},
        "outputs": {"top_ids": {"shape": ["batch", 1, 8], "topk": {"k": 8, "take": "ids"}},
                    "top_logits": {"shape": ["batch", 1, 8], "dtype": "float32",
                                   "topk": {"k": 8, "take": "values"}}},
        "buckets": {"batch": sorted({1, 8, 32, args.batch})},
        "capture": {"warmup_iters": 3, "verify": {"enabled": True, "rtol": 2e-2, "atol": 2e-2}},
        "data": {"path": str(data), "batch_size": args.batch},
        "output": {"dir": str(path.parent / "runs"), "format": "npy", "rows_per_file": 65536},
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return wall


def outputs(out: Path) -> dict[str, np.ndarray]:
    return {name: np.concatenate([np.load(f) for f in sorted(out.glob(f"part-*.{name}.npy"))])
            for name in ("ids", "top_ids", "top_logits")}


def spread(got: dict, first: dict) -> tuple[float, float] | None:
    """(largest logit difference, share of records whose top ids differ); None when the
    records themselves differ."""
    if any(got[k].shape != first[k].shape for k in first) or \
            not np.array_equal(got["ids"], first["ids"]):
        return None
    diff = float(np.abs(got["top_logits"] - first["top_logits"]).max(initial=0.0))
    swapped = float((got["top_ids"] != first["top_ids"]).any(axis=(1, 2)).mean())
    return diff, swapped


def compare(got: dict, first: dict, floor: tuple[float, float] | None) -> str:
    """"bitwise"; else the differences, judged against `floor`, the 1-GPU run's own spread
    from one process to the next (a bf16 step whose kernels round one unit apart swaps
    near-equal logits; on the CPU, fewer torch threads a worker sum in another order);
    "NO: ..." where the records are not the same, or differ beyond twice that spread."""
    found = spread(got, first)
    if found is None:
        return "NO: other records"
    if all(np.array_equal(got[k], first[k]) for k in first):
        return "bitwise"
    diff, swapped = found
    text = f"max diff {diff:.1e}" + (f", top ids differ in {swapped:.3%}" if swapped else "")
    fd, fs = floor or (0.0, 0.0)
    ok = diff <= max(0.1, 2 * fd) and swapped <= max(1e-3, 2 * fs)
    return text + (" (within 1 GPU's spread)" if ok and floor else "") if ok else f"NO: {text}"


def run_all(args, work: Path) -> list[dict]:
    data, spec = work / "decode.npz", work / "bench-scale.yaml"
    write_input(data, args.records, 512 if args.smoke else 32000, 64 if args.smoke else 512)
    write_spec(spec, data, args)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    base = [sys.executable, "-m", "graphrun", "run", str(spec), "-q", "--out"]
    one = "1 GPU" if not args.smoke else "1 process"
    runs = [(one, base + [str(work / "one")]),
            (f"{one}, again", base + [str(work / "again")]),
            (f"--gpus {args.gpus}", base + [str(work / "gpus"), "--gpus", str(args.gpus)]),
            (f"torchrun {args.gpus}", [sys.executable, "-m", "torch.distributed.run",
                                      "--standalone", f"--nproc-per-node={args.gpus}", "-m",
                                      "graphrun", "run", str(spec), "-q", "--out",
                                      str(work / "torchrun")])]
    rows, first, floor = [], None, None
    for label, cmd in runs:
        out = Path(cmd[cmd.index("--out") + 1])
        wall = timed(cmd, env)
        m = json.loads((out / "manifest.json").read_text())
        got = outputs(out)
        if first is None:
            first = got
        if out.name == "again":  # the 1-GPU run's own spread, which the others are held to
            floor = spread(got, first)
            equal = "bitwise" if floor == (0.0, 0.0) else (
                f"its own spread: max diff {floor[0]:.1e}, top ids differ in {floor[1]:.3%}"
                if floor else "NO: other records")
        else:
            equal = compare(got, first, floor)
        t = m["totals"]
        rows.append({"run": label, "wall_s": wall, "records": t["records_out"],
                     "records_per_s": t["records_per_s"], "stream_s": t["stream_s"],
                     "setup_s": t["setup_s"],
                     "workers": [{"device": w["device"], "records_per_s": w["records_per_s"],
                                  "setup_s": w["setup_s"]} for w in m["workers"]],
                     "equal_to_first": equal, "gpu": (m["environment"] or {}).get("gpu")})
        if out.name != "one":
            shutil.rmtree(out)
    return rows


def report(rows: list[dict]) -> str:
    one = rows[0]["records_per_s"]
    lines = ["| run | records | wall s | stream s | records/s | speedup | per worker records/s "
             "| = 1 GPU |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = ", ".join(f"{w['device']} {w['records_per_s']:,.0f}" for w in r["workers"]) or "-"
        lines.append(f"| {r['run']} | {r['records']:,} | {r['wall_s']:.1f} | "
                     f"{r['stream_s']:.2f} | {r['records_per_s']:,.0f} | "
                     f"{r['records_per_s'] / one:.2f}x | {per} | "
                     f"{r['equal_to_first']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=None, help="default 524288 (smoke 8192)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.records = args.records or (8192 if args.smoke else 524288)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = run_all(args, work)
    print(f"decoder step, {args.records:,} records from .npz, batch {args.batch}, "
          f"{rows[0]['gpu'] or 'CPU'}")
    print(report(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    if any(r["equal_to_first"].startswith("NO") for r in rows):
        sys.exit("outputs differ from the first run's")


if __name__ == "__main__":
    main()
