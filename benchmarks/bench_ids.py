"""Peak memory of reading a JSONL whose records carry ids (the duplicate-id check remembers
every id) against the same file without ids: each pass in a child process of its own, which
prints its peak RSS (ru_maxrss) once read_batches has gone through the whole file.

    PYTHONPATH=. python3 benchmarks/bench_ids.py [--sizes 1000000,4000000] [--tree CHECKOUT]

The records are the decoder's (tokens [1], positions), ids `request-<12 digits>`, as
bench_reader.py's decoder spec reads them. Record the figures in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import resource, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from benchmarks.bench_reader import decoder_spec
from graphrun.base.tuning import Tuning
from graphrun.read.stream import read_batches
spec = decoder_spec(Path({path!r}), Path({out!r}), batch_size=1024)
if not {ids}:
    spec = spec.model_copy(update={{"data": spec.data.model_copy(update={{"id_field": None}})}})
t0, n = time.perf_counter(), 0
for b in read_batches(spec, tuning=Tuning(jsonl_workers=0)):
    n += len(b)
print(n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter() - t0)
"""


def write_jsonl(path: Path, n: int, ids: bool) -> None:
    with open(path, "w") as f:
        for start in range(0, n, 100_000):
            f.write("".join((f'{{"id": "request-{i:012d}", ' if ids else "{") +
                            f'"tokens": [{i % 32000}], '
                            f'"positions": {i % 512}}}\n'
                            for i in range(start, min(n, start + 100_000))))


def measure(path: Path, ids: bool, tree: str) -> tuple[int, float, float]:
    """(records read, peak RSS in MiB, seconds) of one pass in a child process."""
    code = CHILD.format(root=tree, path=str(path),
                        out=str(path.parent / "out"), ids=ids)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          )
    if done.returncode:
        raise SystemExit(done.stderr)
    n, rss, seconds = done.stdout.split()
    return int(n), int(rss) / 1024, float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,4000000",
                        help="record counts, comma-separated")
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent),
                        help="the checkout whose graphrun is measured (default: this one)")
    args = parser.parse_args()
    print("records     ids  peak RSS MiB  read s   MiB over no ids  bytes/record over no ids")
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, args.sizes.split(",")):
            path = Path(tmp) / f"records-{n}.jsonl"
            write_jsonl(path, n, ids=False)
            _, flat, s0 = measure(path, False, args.tree)
            print(f"{n:>10,}  no   {flat:>12.0f}  {s0:>6.1f}", flush=True)
            t0 = time.perf_counter()
            write_jsonl(path, n, ids=True)
            print(f"# wrote {n} records with ids, {path.stat().st_size / 2**20:.0f} MiB, in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            got, peak, s1 = measure(path, True, args.tree)
            assert got == n
            over = peak - flat
            print(f"{n:>10,}  yes  {peak:>12.0f}  {s1:>6.1f}   {over:>15.0f}  "
                  f"{over * 2**20 / n:>24.1f}", flush=True)
            path.unlink()


if __name__ == "__main__":
    main()
