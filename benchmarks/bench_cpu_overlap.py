"""The data path on the CPU: records/s of `graphrun run` on the shipped pipelines, serial (the
CPU's default) against overlapped (GRAPHRUN_OVERLAP=on).

    python3 benchmarks/bench_cpu_overlap.py [--pipelines mlp-scorer,decoder-step,encoder]
        [--records 1000000] [--repeat 3] [--workdir DIR] [--out FILE]

Inputs are made by examples/make_data.py: --records rows for the MLP, a fifth of that many
decode steps and a hundredth of that many texts for the encoder, so that each run streams for
10-20 s. Each pipeline runs `--repeat` times on each path, the two paths in turn within a
repetition (so a drift in the machine's speed weighs on both); the table gives each path's
median records/s (manifest totals.records_per_s) and their ratio. Run it on an idle
machine: on a shared one, only ratios within one run of this script mean anything.
With CUDA present the runs are forced onto the CPU (device=cpu).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import graphrun  # noqa: E402

PATHS = (("serial", False), ("overlapped", True))
INPUTS = {"mlp-scorer": "scores.npy", "decoder-step": "decode.jsonl", "encoder": "texts.jsonl"}


def make_inputs(workdir: Path, records: int) -> None:
    """The shipped pipelines' inputs: `records` rows, a fifth as many decode steps, a
    hundredth as many texts."""
    sys.path.insert(0, str(ROOT / "examples"))
    import make_data

    rng = np.random.default_rng(0)
    for name, n, make in (("scores.npy", records, make_data.make_scores),
                          ("decode.jsonl", max(1, records // 5), make_data.make_decode),
                          ("texts.jsonl", max(1, records // 100), make_data.make_texts)):
        done = workdir / f"{name}.{n}"  # made already, at this size
        if not done.exists():
            make(workdir / name, n, rng)
            done.touch()


def run_once(pipeline: str, data: Path, out: Path, overlap) -> graphrun.Manifest:
    spec = graphrun.load_spec(ROOT / "pipelines" / f"{pipeline}.yaml",
                              overrides=[f"data.path={data}", "device=cpu"])
    shutil.rmtree(out, ignore_errors=True)
    try:
        return graphrun.run(spec, out=out, overlap=overlap)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipelines", default=",".join(INPUTS))
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="write the markdown report here too")
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="graphrun-cpu-overlap-"))
    workdir.mkdir(parents=True, exist_ok=True)
    make_inputs(workdir, args.records)

    lines = [f"bench_cpu_overlap.py, {datetime.date.today()}: torch {torch.__version__}, "
             f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
             f"--records {args.records} --repeat {args.repeat}", "",
             "| pipeline | serial | overlapped | overlapped / serial |",
             "|---|---|---|---|"]
    notes = []
    for pipeline in args.pipelines.split(","):
        data = workdir / INPUTS[pipeline]
        rates: dict[str, list[float]] = {name: [] for name, _ in PATHS}
        for rep in range(args.repeat):
            for name, overlap in PATHS:
                m = run_once(pipeline, data, workdir / "out", overlap)
                rates[name].append(m.totals.records_per_s)
                print(f"{pipeline} {name} {m.totals.records_per_s:,.0f} records/s", flush=True)
        med = {name: statistics.median(v) for name, v in rates.items()}
        lines.append(
            f"| {pipeline} ({data.name}) | {med['serial']:,.0f} | {med['overlapped']:,.0f} | "
            f"{med['overlapped'] / med['serial']:.3f} |")
        notes.append(f"{pipeline}: " + "; ".join(
            f"{name} " + ", ".join(f"{r:,.0f}" for r in v) for name, v in rates.items()))
    lines += ["", "Every run's records/s, in order:", ""] + [f"- {n}" for n in notes]
    lines += ["", f"Command: `python3 {' '.join(sys.argv)}`"]
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
