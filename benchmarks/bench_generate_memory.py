"""Memory of a generation job as it grows (issue 50's "RSS stays flat on a 100k-prompt
generation job"): the CPU job over the shipped tiny Llama on generated prompts, each size in a
child process of its own, which runs graphrun.run and samples its own RSS meanwhile.

    PYTHONPATH=. python3 benchmarks/bench_generate_memory.py [--sizes 10000,100000]
        [--new-tokens 2] [--slots 64] [--tree CHECKOUT]

Prompts: `p-<7 digits>` ids, 4 to 16 words from a fixed list (up to about 70 tokens), seeded;
greedy, stop.eos none (every record gets --new-tokens tokens), buckets batch [--slots], seq
[16, 32, 64, 128], jsonl out. Printed per size: the records written, seconds, peak RSS (ru_maxrss)
and the RSS sampled after a tenth, half and all of the run's time. Flat means the peak does not
grow with the records. Record the figures in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "examples" / "models" / "tiny-llama"
WORDS = ("the old fisherman discovered a rare orchid near harbour while storm clouds gathered "
         "over station and research team celebrated faster route through mountains because "
         "weather forecast promised week of rain").split()

CHILD = """
import resource, sys, threading, time
sys.path.insert(0, {root!r})
import graphrun
samples, done = [], threading.Event()
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
def watch():
    while not done.wait(0.25):
        samples.append((time.perf_counter(), rss()))
threading.Thread(target=watch, daemon=True).start()
t0 = time.perf_counter()
manifest = graphrun.run(graphrun.load_spec({spec!r}), tuning=None)
seconds = time.perf_counter() - t0
done.set()
at = lambda share: max([r for t, r in samples if t - t0 <= share * seconds] or [0.0])
print(manifest.totals.records_out, round(seconds, 1),
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, at(0.1), at(0.5), rss())
"""


def write_prompts(path: Path, n: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            words = rng.choices(WORDS, k=rng.randint(4, 16))
            f.write(json.dumps({"id": f"p-{i:07d}", "prompt": " ".join(words)}) + "\n")


def write_spec(folder: Path, data: Path, new_tokens: int, slots: int) -> Path:
    spec = {"version": 1, "name": "gen-memory", "device": "cpu",
            "model": {"hf": {"path": str(FOLDER), "class": "AutoModelForCausalLM"},
                      "dtype": "float32"},
            "data": {"path": str(data), "id_field": "id",
                     "text": {"field": "prompt", "truncate": False}, "batch_size": slots},
            "generate": {"max_new_tokens": new_tokens, "sampling": {"method": "greedy"},
                         "stop": {"eos": "none"}},
            "buckets": {"batch": [slots], "seq": [16, 32, 64, 128]},
            "output": {"dir": str(folder / "out"), "format": "jsonl"}}
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def measure(spec: Path, tree: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", CHILD.format(root=tree, spec=str(spec))],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return done.stdout.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000", help="prompt counts, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=2)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--tree", default=str(ROOT),
                        help="the checkout whose graphrun is measured (default: this one)")
    args = parser.parse_args()
    print("prompts   records out  seconds  peak RSS MiB  RSS at 10% MiB  at 50%  at end")
    for n in map(int, args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "prompts.jsonl"
            write_prompts(data, n)
            out, seconds, peak, tenth, half, end = measure(
                write_spec(Path(tmp), data, args.new_tokens, args.slots), args.tree)
            print(f"{n:>7,}  {int(out):>11,}  {float(seconds):>7.1f}  {float(peak):>12.0f}  "
                  f"{float(tenth):>14.0f}  {float(half):>6.0f}  {float(end):>6.0f}", flush=True)


if __name__ == "__main__":
    main()
