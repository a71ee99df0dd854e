#!/usr/bin/env bash
# Generation on a GPU machine, in two calls that each fit the device's 10 minutes. Run from the
# project root with graphrun, transformers and tokenizers importable (benchmarks/README.md).
#   bash scripts/gpu-check-generate.sh step   # the CUDA tests of generation, one decode step
#                                             # taken apart (about 6 minutes on an H200)
#   bash scripts/gpu-check-generate.sh job    # whole graphrun processes on the varied-length
#                                             # job, plain and model.compile (about 7 minutes)
# Reports go to $OUT (default ./gpu-out):
#   step: generate-tests.txt (pytest -m cuda over generation and its kernels), step-8b.txt /
#         .json (bench_decode_step.py, 8B at 256 rows, KV length 160, sampled: matmuls, plain,
#         plain-unfused, --profile: issue 48's step target), step-1b.txt / .json (1.24B at 64
#         rows: matmuls, plain, compile)
#   job:  job-b1.txt / .json (48 prompts), job-b64.txt / .json (256 prompts):
#         bench_generate.py --parts job --ways graphrun,graphrun-compile, 1.24B
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
case "${1:-}" in
  step)
    python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_paged_attention.py \
        tests/test_fused.py tests/test_generate_sampling.py tests/test_warm.py \
        tests/test_generate_cuda.py tests/test_generate_engine.py \
        > "$OUT/generate-tests.txt" 2>&1
    tail -1 "$OUT/generate-tests.txt"
    timeout 200 python3 benchmarks/bench_decode_step.py --layout 8B --rows 256 --kv-len 160 \
        --sample --ways matmuls,plain,plain-unfused --profile --json "$OUT/step-8b.json" \
        > "$OUT/step-8b.txt" 2>&1 || echo "step, 8B: failed"
    grep "^| \|^## " "$OUT/step-8b.txt"
    timeout 100 python3 benchmarks/bench_decode_step.py --layout 1.24B --rows 64 --kv-len 512 \
        --ways matmuls,plain,compile --json "$OUT/step-1b.json" > "$OUT/step-1b.txt" 2>&1 \
        || echo "step, 1.24B: failed"
    grep "^| \|^## " "$OUT/step-1b.txt"
    ;;
  job)
    for run in "1 48" "64 256"; do
      set -- $run
      timeout 270 python3 benchmarks/bench_generate.py --models 1.24B --batches "$1" \
          --ways graphrun,graphrun-compile --parts job --prompts "$2" --max-seconds 20 \
          --json "$OUT/job-b$1.json" > "$OUT/job-b$1.txt" 2>&1 || echo "job, batch $1: failed"
      grep "^| \|^- " "$OUT/job-b$1.txt" | grep -v -- "---"
    done
    ;;
  *)
    echo "usage: bash scripts/gpu-check-generate.sh step|job" >&2
    exit 2
    ;;
esac
