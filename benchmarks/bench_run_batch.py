"""Runner.run_batch on pinned host tensors against the seed's hand-written loop, measured in
one process, in alternating rounds, on the same model and inputs.

    python3 benchmarks/bench_run_batch.py [--batches 1,8] [--iters 300] [--rounds 5]
        [--out FILE] [--smoke]

The model is the builtin decoder (12 layers x 768, 12 heads, vocab 32000, KV cache 512, bf16;
tiny with --smoke or on a CPU, where the hand-written loop has no graph and calls the model).
Per batch, each round times `iters` steps of each variant, one after the other; a step is
host wall time (perf_counter) around one call that ends synchronized, and the table gives the
median over every round's steps:
  hand      static inputs copied from pinned tensors, g.replay(), copy out into one pinned
            tensor, synchronize (the seed's loop; graph captured after 3 side-stream warm-ups)
  run_batch Runner.run_batch({name: pinned tensor}): new pinned output tensors each call
and the parts of run_batch's host time (no synchronize; medians of `iters` calls):
  check     engine.inputs.check_batch alone (rank, sizes, range)
  replay    each graph replayed back to back, CUDA events: the device time of the step, so a
            difference there is the graphs', not the host's
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphrun.engine import Runner  # noqa: E402
from graphrun.engine.inputs import check_batch  # noqa: E402
from graphrun.models.load import build_model  # noqa: E402
from graphrun.spec.keys import PipelineSpec  # noqa: E402

SETS = 8  # distinct input sets, cycled


def make_spec(args: dict, buckets: list[int], tmp: Path, cuda: bool) -> PipelineSpec:
    data = tmp / "dummy.jsonl"
    data.write_text('{"id": 0}\n')
    return PipelineSpec.model_validate({
        "version": 1, "name": "bench-run-batch", "device": "cuda" if cuda else "cpu",
        "model": {"builtin": "decoder", "args": args, "dtype": "bfloat16"},
        "inputs": {"tokens": {"shape": ["batch", 1], "dtype": "int64", "range": [0, args["vocab"]]},
                   "positions": {"shape": ["batch"], "dtype": "int64",
                                 "range": [0, args["max_len"]]}},
        "outputs": {"logits": {"shape": ["batch", 1, args["vocab"]]}},
        "buckets": {"batch": buckets},
        "capture": {"backend": "cuda-graph" if cuda else "eager", "warmup_iters": 3,
                    "lazy": False, "verify": {"enabled": True, "rtol": 2e-2, "atol": 2e-2}},
        "data": {"path": str(data), "batch_size": max(buckets)},
        "output": {"dir": str(tmp / "out")},
    })


def input_sets(args: dict, batch: int, cuda: bool) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(1000 + batch)
    sets = []
    for _ in range(SETS):
        s = {"tokens": torch.from_numpy(rng.integers(0, args["vocab"], (batch, 1))),
             "positions": torch.from_numpy(rng.integers(0, args["max_len"], (batch,)))}
        sets.append({n: t.pin_memory() if cuda else t for n, t in s.items()})
    return sets


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def steps_us(step, iters: int, cuda: bool) -> list[float]:
    for i in range(10):
        step(i)
    sync(cuda)
    out = []
    for i in range(iters):
        t0 = time.perf_counter()
        step(i)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def logits(ret) -> torch.Tensor:
    return ret["logits"] if isinstance(ret, dict) else ret


def hand_loop(model, sets, cuda: bool):
    """The seed's loop: capture once, then copy in, replay, copy out, synchronize."""
    static_in = {n: t.clone().to("cuda" if cuda else "cpu") for n, t in sets[0].items()}
    if not cuda:
        def eager(i):
            for n, t in sets[i % SETS].items():
                static_in[n].copy_(t)
            return logits(model(**static_in)).clone()
        return eager, None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(**static_in)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = logits(model(**static_in))
    host_out = torch.empty(static_out.shape, dtype=static_out.dtype, pin_memory=True)

    def step(i):
        for n, t in sets[i % SETS].items():
            static_in[n].copy_(t, non_blocking=True)
        g.replay()
        host_out.copy_(static_out, non_blocking=True)
        torch.cuda.synchronize()
        return host_out
    return step, g


def replay_us(graph, iters: int) -> float | None:
    """Device time per replay, back to back (CUDA events)."""
    if graph is None:
        return None
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    args = ({"layers": 2, "d_model": 64, "heads": 4, "vocab": 512, "max_len": 64}
            if a.smoke or not cuda else
            {"layers": 12, "d_model": 768, "heads": 12, "vocab": 32000, "max_len": 512})
    batches = [int(b) for b in a.batches.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench_run_batch-"))
    spec = make_spec(args, sorted(set(batches) | {1, 8, 32}), tmp, cuda)
    device = torch.device("cuda" if cuda else "cpu")
    rows = []
    with torch.inference_mode():
        model = build_model(spec, device)
    with Runner(spec) as runner, torch.inference_mode():  # as bench_capture.py times them
        for b in batches:
            sets = input_sets(args, b, cuda)
            hand, graph = hand_loop(model, sets, cuda)
            want = hand(0).float().clone()
            got = runner.run_batch(sets[0])["logits"].float()
            diff = float((got.reshape(want.shape) - want).abs().max())
            times: dict[str, list[float]] = {"hand": [], "run_batch": []}
            for _ in range(a.rounds):  # alternating: drift on the machine hits both alike
                times["hand"] += steps_us(hand, a.iters, cuda)
                times["run_batch"] += steps_us(lambda i: runner.run_batch(sets[i % SETS]),
                                               a.iters, cuda)
            check = steps_us(lambda i: check_batch(sets[i % SETS], runner.spec.inputs,
                                                   runner.table.axes), a.iters, False)
            bucket = runner.table.pick(b, {})
            ours = runner.lanes[0].graphs[bucket].graph if cuda else None
            hand_med = statistics.median(times["hand"])
            ours_med = statistics.median(times["run_batch"])
            rows.append((b, hand_med, ours_med, ours_med / hand_med, statistics.median(check),
                         replay_us(graph, a.iters), replay_us(ours, a.iters), diff))
            print(f"B={b}: hand {hand_med:.1f} us, run_batch {ours_med:.1f} us "
                  f"({ours_med / hand_med:.3f}x)", flush=True)
    text = report(rows, a, cuda, args)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


def report(rows, a, cuda: bool, args: dict) -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""

    def us(x):
        return "-" if x is None else f"{x:.1f}"
    lines = ["# bench_run_batch.py: run_batch against the hand-written loop, one process", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"- GPU: {torch.cuda.get_device_name(0) if cuda else 'none (CPU)'}, torch "
             f"{torch.__version__}, host {platform.node()}, python {platform.python_version()}",
             f"- graphrun: {ROOT} (commit {commit or 'unknown'}), decoder {args}, bf16",
             f"- command: python3 benchmarks/bench_run_batch.py {' '.join(sys.argv[1:])}",
             f"- {a.rounds} alternating rounds of {a.iters} steps per variant", "",
             "| batch | hand us | run_batch us | run_batch / hand | check_batch us | "
             "hand graph replay us (events) | graphrun graph replay us (events) | max abs diff |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b, hand, ours, ratio, check, r_hand, r_ours, diff in rows:
        lines.append(f"| {b} | {hand:.1f} | {ours:.1f} | {ratio:.3f}x | {check:.1f} | "
                     f"{us(r_hand)} | {us(r_ours)} | {diff:.3g} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
