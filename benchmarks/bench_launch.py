"""The launching thread's cost: host microseconds per Runner.launch and per CUDA call in it,
alone and with other Python threads competing for the GIL (as the stager and completer do).

    python3 benchmarks/bench_launch.py [--batch 1024] [--iters 2000] [--out FILE]

The model is bench_datapath.py's MLP (bf16, 24 x 1024, in 256, out 16) on the GPU (tiny and
eager on a CPU). Each figure is the median over blocks of the host time of the call alone
(the device is kept from falling behind by a synchronize between blocks, so no call waits for
a full launch queue).

  per call    set_stream, Event.record, Stream.wait_event, copy_ h2d (pinned, non_blocking),
              copy_ d2d, copy_ d2d with a cast, copy_ d2h, CUDAGraph.replay
  launch      Runner.launch, timed and untimed, then timer.finish (not counted)
  contended   launch timed, with 2 threads running pure Python in a loop: at each call that
              releases the GIL a spinner takes it, and the launch waits for the switch interval
              (5 ms) to get it back, so few iterations
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphrun.engine import Runner  # noqa: E402
from graphrun.spec.keys import PipelineSpec  # noqa: E402


def spec(tmp: Path, batch: int, cuda: bool) -> PipelineSpec:
    (tmp / "d.jsonl").write_text("")
    args = ({"in_features": 256, "hidden": 1024, "layers": 24, "out_features": 16} if cuda
            else {"in_features": 32, "hidden": 64, "layers": 2, "out_features": 16})
    return PipelineSpec.model_validate({
        "version": 1, "name": "bench-launch", "device": "cuda" if cuda else "cpu",
        "model": {"builtin": "mlp", "args": args, "dtype": "bfloat16" if cuda else "float32"},
        "inputs": {"x": {"shape": ["batch", args["in_features"]],
                         "dtype": "bfloat16" if cuda else "float32"}},
        "outputs": {"y": {"shape": ["batch", 16]}},
        "buckets": {"batch": [batch]},
        "capture": {"verify": {"rtol": 2e-2, "atol": 2e-2}},
        "data": {"path": str(tmp / "d.jsonl")}, "output": {"dir": str(tmp / "o")}})


def per_call_us(fn, iters: int, sync) -> float:
    blocks = []
    for _ in range(max(1, iters // 50)):
        sync()
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        blocks.append((time.perf_counter() - t0) / 50 * 1e6)
    sync()
    return statistics.median(blocks)


def launch_us(runner: Runner, bucket, iters: int, *, timed: bool, stream) -> float:
    times = []
    slot = 0
    for _ in range(iters):
        t0 = time.perf_counter()
        launched = runner.launcher.launch(bucket, slot, bucket.batch, {}, timed=timed,
                                          stream=stream)
        times.append((time.perf_counter() - t0) * 1e6)
        launched.wait()
        slot = (slot + 1) % len(runner.launcher.slots)
    return statistics.median(times)


def spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(200):
            x += i


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    import tempfile
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Runner(spec(Path(tmp), args.batch, cuda)) as r:
        r.launcher.host_slots(4)
        bucket = r.table.all[0]
        x = np.random.default_rng(0).standard_normal((args.batch, r.spec.inputs["x"].shape[1]))
        slots = r.launcher.slots
        for s in range(len(slots)):
            r.launcher.stage({"x": x.astype(np.float32)}, args.batch, {}, s)
        with r.launcher.device_context():
            stream = r.launcher.current_stream()
            sync = torch.cuda.synchronize if cuda else (lambda: None)
            for _ in range(20):  # warm: every slot's copies built, events made
                r.launcher.launch(bucket, _ % len(slots), args.batch, {}, stream=stream).wait()
            if cuda:
                lane0, lane1 = r.lanes[0], r.lanes[-1]
                c = slots[0].copies(bucket, lane0)
                lane1_x = lane1.inputs.flat["x"]  # a device-to-device copy between lanes
                ev = torch.cuda.Event(enable_timing=True)
                cast = torch.empty(lane0.outputs.flat["y"].shape, dtype=torch.float32,
                                   device=r.device)
                calls = {
                    "set_stream": lambda: torch.cuda.set_stream(stream),
                    "Event.record": lambda: ev.record(stream),
                    "Stream.wait_event": lambda: stream.wait_event(ev),
                    "copy_ h2d 1 input": lambda: c.h2d[0][0].copy_(c.h2d[0][1], non_blocking=True),
                    "copy_ d2d same dtype": lambda: lane1_x.copy_(lane0.inputs.flat["x"],
                                                                  non_blocking=True),
                    "copy_ d2d bf16->f32": lambda: cast.copy_(lane0.outputs.flat["y"],
                                                              non_blocking=True),
                    "copy_ d2h 1 output": lambda: c.d2h[0][0].copy_(c.d2h[0][1], non_blocking=True),
                    "CUDAGraph.replay": lane0.graphs[bucket].run,
                    "torch.cuda.current_stream": torch.cuda.current_stream,
                }
                for name, fn in calls.items():
                    rows.append((name, per_call_us(fn, 1000 if "replay" not in name else 200,
                                                   sync)))
                    print(f"{name}: {rows[-1][1]:.1f} us", flush=True)
            rows.append(("launch, timed", launch_us(r, bucket, args.iters, timed=True,
                                                    stream=stream)))
            rows.append(("launch, untimed", launch_us(r, bucket, args.iters, timed=False,
                                                      stream=stream)))
            stop = threading.Event()
            threads = [threading.Thread(target=spin, args=(stop,), daemon=True)
                       for _ in range(2)]
            for t in threads:
                t.start()
            try:
                rows.append(("launch, timed, 2 Python threads spinning",
                             launch_us(r, bucket, args.iters // 40, timed=True, stream=stream)))
                rows.append(("launch, untimed, 2 Python threads spinning",
                             launch_us(r, bucket, args.iters // 40, timed=False, stream=stream)))
            finally:
                stop.set()
                for t in threads:
                    t.join()
    text = (f"# bench_launch.py ({'GPU ' + torch.cuda.get_device_name() if cuda else 'CPU'}, "
            f"torch {torch.__version__}, batch {args.batch}, switch interval "
            f"{sys.getswitchinterval() * 1e3:g} ms)\n\n| call | host us (median) |\n|---|---|\n"
            + "".join(f"| {name} | {us:,.1f} |\n" for name, us in rows))
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
