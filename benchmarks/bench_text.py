"""Text read rate: records/s of read_batches over a JSONL file of mixed-length sentences
tokenized with all-MiniLM-L6-v2's fast tokenizer (data.text), and the same with a consumer
that spends a fixed time per batch waiting off the GIL (as a launcher waits on the device):
in line the two add up, with the tokenizer ahead of the stream the wait hides the reading.

    PYTHONPATH=. python3 benchmarks/bench_text.py [--sentences 5000] [--batch-size 256]
        [--consume-ms 0,10] [--repeat 5] [--pairs]

The sentences are bench_minilm.py's (log-normal lengths, 4..128 tokens); --pairs reads each
record as a (query, passage) pair: the first 8 words of a sentence and the sentence.
Each row: the median of --repeat passes (this machine may be shared), the caller's thread CPU
per pass (what the stager itself spends), and the process's CPU. GRAPHRUN_TEXT_THREADS=0
tokenizes on the caller's thread (in line), as GRAPHRUN_JSONL_WORKERS sets the child processes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks", ROOT / "examples"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import graphrun  # noqa: E402
from bench_minilm import write_texts  # noqa: E402
from graphrun.base.tuning import Tuning  # noqa: E402
from graphrun.read.stream import read_batches  # noqa: E402


def make_pairs(path: Path, out: Path) -> None:
    with out.open("w") as f:
        for line in path.open():
            r = json.loads(line)
            f.write(json.dumps({"id": r["id"], "query": " ".join(r["text"].split()[:8]),
                                "passage": r["text"]}) + "\n")


def one_pass(spec, tuning: Tuning, consume_s: float) -> tuple[int, float, float, float]:
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    n = 0
    for batch in read_batches(spec, tuning=tuning):
        n += len(batch)
        if consume_s:
            time.sleep(consume_s)  # the launcher's wait: off the GIL, as a device wait is
    return n, time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - p0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sentences", type=int, default=5000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--consume-ms", default="0,10")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--pairs", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_text_"))
    write_texts(work / "texts.jsonl", a.sentences)
    path, extra = work / "texts.jsonl", []
    if a.pairs:
        make_pairs(work / "texts.jsonl", work / "pairs.jsonl")
        path, extra = work / "pairs.jsonl", ["data.text.field=[query,passage]"]
    spec = graphrun.load_spec(ROOT / "pipelines" / "minilm-embed.yaml", [
        f"data.path={path}", f"data.batch_size={a.batch_size}",
        f"buckets.batch=[1,8,32,{a.batch_size}]", "data.group_by_length=null", *extra])
    tuning = Tuning.from_machine()
    one_pass(spec, tuning, 0)  # the tokenizer loaded, the file in the page cache
    import torch
    print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}; {a.sentences} "
          f"{'pairs' if a.pairs else 'sentences'}, batch {a.batch_size}; "
          f"text_threads={getattr(tuning, 'text_threads', '-')}, "
          f"jsonl_workers={tuning.jsonl_workers}")
    print("| consume ms/batch | records/s | wall s | caller CPU s | process CPU s |")
    print("|---|---|---|---|---|")
    for ms in (float(v) for v in a.consume_ms.split(",")):
        runs = [one_pass(spec, tuning, ms / 1000) for _ in range(a.repeat)]
        n = runs[0][0]
        wall = statistics.median(r[1] for r in runs)
        print(f"| {ms:g} | {n / wall:,.0f} | {wall:.3f} | "
              f"{statistics.median(r[2] for r in runs):.3f} | "
              f"{statistics.median(r[3] for r in runs):.3f} |")


if __name__ == "__main__":
    main()
