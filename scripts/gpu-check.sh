#!/usr/bin/env bash
# Everything a GPU machine checks, in one call. Run from the project root on a CUDA machine
# with graphrun installed (`pip install -e ".[test]" orjson py-spy`: orjson so that JSONL parses
# as users' installs do, py-spy for the GIL profile; see benchmarks/README.md).
# Reports go to $OUT (default ./gpu-out):
#   cuda-tests.txt   pytest -m cuda
#   datapath.md      bench_datapath.py, every format (MLP JSONL: 50,000 records), the
#                    median of 3 overlapped runs
#   datapath-f16.md  the decoder with float16 logits
#   datapath-vocab1000.md  the decoder at the shipped spec's vocabulary, 100k records
#   launch.md        bench_launch.py: host us per CUDA call and per launch
#   writer.md        bench_writer.py on this machine's disk
#   gil.txt          py-spy --gil samples of an overlapped MLP npy run, summed per thread
#   capture.md       bench_capture.py without the torch.compile rows (only with --capture)
# About 7 minutes (9 with --capture), the machine's start not counted.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
python3 -m pytest -m cuda -q -p no:cacheprovider > "$OUT/cuda-tests.txt" 2>&1
tail -1 "$OUT/cuda-tests.txt"
python3 benchmarks/bench_datapath.py --formats npy,parquet,jsonl --jsonl-records 50000 \
    --repeat 3 --out "$OUT/datapath.md" > /dev/null 2>&1 || echo "bench_datapath failed"
python3 benchmarks/bench_datapath.py --models decoder --formats npy --logits-dtype float16 \
    --out "$OUT/datapath-f16.md" > /dev/null 2>&1 || echo "bench_datapath (float16) failed"
python3 benchmarks/bench_datapath.py --models decoder --decoder-vocab 1000 \
    --records-decoder 100000 --formats npy,parquet,jsonl --repeat 3 \
    --out "$OUT/datapath-vocab1000.md" \
    > /dev/null 2>&1 || echo "bench_datapath (vocab 1000) failed"
python3 benchmarks/bench_launch.py --out "$OUT/launch.md" > /dev/null 2>&1 \
    || echo "bench_launch failed"
python3 benchmarks/bench_writer.py --out-dir "${TMPDIR:-/tmp}" --repeat 3 > "$OUT/writer.md" 2>&1
if command -v py-spy > /dev/null || [ -x /tmp/site/bin/py-spy ]; then
    spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
    "$spy" record --gil --threads -r 400 -f raw -o "$OUT/gil.raw" -- \
        python3 benchmarks/bench_datapath.py --models mlp --formats npy --records 1000000 \
        > /dev/null 2>&1
    python3 benchmarks/gil_summary.py "$OUT/gil.raw" > "$OUT/gil.txt" && rm "$OUT/gil.raw"
fi
if [ "${1:-}" = "--capture" ]; then
    python3 benchmarks/bench_capture.py --skip-compile --out "$OUT/capture.md" > /dev/null 2>&1
fi
grep -h "^| " "$OUT"/datapath*.md | head -40
