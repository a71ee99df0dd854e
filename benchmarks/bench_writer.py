"""The ShardWriter alone: records/s and MB/s over synthetic model outputs, shard commits
(fsync, sha256, rename, rejects, journal) included.

    PYTHONPATH=. python3 benchmarks/bench_writer.py [--cases decoder,mlp] [--out-dir DIR]
        [--records-decoder 20000] [--records-mlp 1000000] [--repeat 3] [--ids array]

Cases (npy, ids = ordinals, one reject every 997 records, as bench_datapath's writer feeds it):
  decoder  32000 float32 per record (128 KB, a decoder's full logits), batches of 32,
           shards of 5000 rows: one commit every 640 MB
  mlp      16 float32 per record, batches of 1024, shards of 100,000 rows
ids: `array` passes each batch's ids as the int64 array the reader hands out for ordinals and
integer ids; `list` as a list of Python ints (JSONL ids, and every id before the reader kept them
as arrays). Each batch is one of 4 distinct random arrays, cycled (never all zeros). `stream` is the time
of the write()/reject() calls alone (`write us/batch`: the write() calls' time per batch, the
writer's time on the calling thread: the completer's in a run), `total` adds close(), which waits for every commit: rates
are taken from total, the time until the last shard is durable and journaled. Medians over
--repeat runs; the output folder (a fresh one under --out-dir, default a temporary folder:
put it on the disk you care about) is deleted after each run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphrun.spec.keys import PipelineSpec  # noqa: E402
from graphrun.write.shards import ShardWriter  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    width: int  # float32 values per record
    batch: int
    rows_per_file: int


CASES = {"decoder": Case("decoder", 32000, 32, 5000), "mlp": Case("mlp", 16, 1024, 100_000)}
REJECT_EVERY = 997


def make_spec(case: Case, out: Path) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "version": 1, "name": f"bench-writer-{case.name}", "model": {"builtin": "mlp"},
        "inputs": {"x": {"shape": ["batch", 4]}},
        "outputs": {"y": {"shape": ["batch", case.width], "dtype": "float32"}},
        "buckets": {"batch": [case.batch]},
        "data": {"path": str(out / "unused.jsonl")},
        "output": {"dir": str(out), "format": "npy", "rows_per_file": case.rows_per_file},
    })


def one_run(case: Case, records: int, out: Path, pool: list[np.ndarray], ids: str = "array"
            ) -> tuple[float, float, float]:
    """(stream seconds, total seconds, write() seconds) of writing `records` records into a
    fresh `out`."""
    shutil.rmtree(out, ignore_errors=True)
    writer = ShardWriter(make_spec(case, out), out)
    t0 = time.perf_counter()
    in_write = 0.0
    for k, lo in enumerate(range(0, records, case.batch)):
        hi = min(lo + case.batch, records)
        index = np.arange(lo, hi)
        bad = index % REJECT_EVERY == REJECT_EVERY - 1
        for i in index[bad].tolist():
            writer.reject(i, i, "bench", "synthetic reject")
        good = index[~bad]
        batch_ids = good if ids == "array" else good.tolist()
        t1 = time.perf_counter()
        writer.write(good, batch_ids, {"y": pool[k % len(pool)][:len(good)]}, batch_start=lo)
        in_write += time.perf_counter() - t1
    stream = time.perf_counter() - t0
    writer.close()
    total = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return stream, total, in_write


def bench(case: Case, records: int, out_dir: Path, repeat: int, ids: str = "array") -> dict:
    rng = np.random.default_rng(0)
    pool = [rng.standard_normal((case.batch, case.width), dtype=np.float32) for _ in range(4)]
    one_run(case, min(records, 4 * case.rows_per_file // 10 + case.batch), out_dir / "warm",
            pool, ids)  # warm-up: imports, page cache, allocator
    runs = [one_run(case, records, out_dir / f"{case.name}-{r}", pool, ids)
            for r in range(repeat)]
    stream = statistics.median(r[0] for r in runs)
    total = statistics.median(r[1] for r in runs)
    in_write = statistics.median(r[2] for r in runs)
    written = records - records // REJECT_EVERY
    mb = written * case.width * 4 / 1e6
    return {"case": case.name, "records": records, "stream_s": stream, "total_s": total,
            "rec_s": records / total, "mb_s": mb / total, "stream_rec_s": records / stream,
            "us_batch": in_write / -(-records // case.batch) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="decoder,mlp")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--records-decoder", type=int, default=20_000)
    ap.add_argument("--records-mlp", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ids", choices=["array", "list"], default="array")
    args = ap.parse_args()
    records = {"decoder": args.records_decoder, "mlp": args.records_mlp}
    with tempfile.TemporaryDirectory(dir=args.out_dir, prefix="bench-writer-") as tmp:
        print("| case | records | stream s | total s | records/s | MB/s | stream records/s "
              "| write us/batch |")
        print("|---|---|---|---|---|---|---|---|")
        for name in args.cases.split(","):
            r = bench(CASES[name], records[name], Path(tmp), args.repeat, args.ids)
            print(f"| {r['case']} | {r['records']:,} | {r['stream_s']:.2f} | {r['total_s']:.2f} "
                  f"| {r['rec_s']:,.0f} | {r['mb_s']:,.0f} | {r['stream_rec_s']:,.0f} "
                  f"| {r['us_batch']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
