"""Sum py-spy's raw samples (`py-spy record --gil --threads -f raw`) per thread and per place.

    python3 benchmarks/gil_summary.py samples.raw [--top 40]

With --gil, py-spy samples only the thread holding the GIL, so the counts say which thread
held it, and where: graphrun's innermost frame and the frame on top. Import-time samples
(importlib frames) are counted apart. The overlapped stream's threads are named
graphrun-stager, graphrun-completer, graphrun-rows, graphrun-sha256, graphrun-fsync,
graphrun-journal, parquet; the launching thread is MainThread.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter


def summarize(lines, top: int) -> str:
    threads, places = Counter(), Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        named = re.match(r"thread \(\w+\):?\s*(.*)", frames[0])
        thread = (named.group(1) if named else frames[0]).strip() or "?"
        if any("importlib._bootstrap" in f for f in frames):
            thread += " [import]"
        ours = [f for f in frames[1:] if "graphrun/" in f]
        where = re.sub(r"\(.*/", "(", ours[-1]) if ours else "-"
        threads[thread] += int(count)
        places[(thread, f"{where} -> {frames[-1][:80]}")] += int(count)
    total = sum(threads.values()) or 1
    out = ["samples per thread:"]
    out += [f"{n:8d} {100 * n / total:5.1f}%  {t}" for t, n in threads.most_common()]
    out += ["", f"top {top} places (graphrun frame -> innermost frame):"]
    running = Counter({k: n for k, n in places.items() if "[import]" not in k[0]})
    out += [f"{n:8d}  {t[:24]:24s} {p}" for (t, p), n in running.most_common(top)]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    with open(args.raw) as f:
        print(summarize(f, args.top))


if __name__ == "__main__":
    main()
