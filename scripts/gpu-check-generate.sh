#!/usr/bin/env bash
# Generation on a GPU machine, in two calls that each fit the device's 10 minutes. Run from the
# project root with graphrun, transformers and tokenizers importable (benchmarks/README.md).
#   bash scripts/gpu-check-generate.sh step   # the CUDA tests of generation, one decode step
#                                             # taken apart (about 6 minutes on an H200)
#   bash scripts/gpu-check-generate.sh job    # whole graphrun processes on the varied-length
#                                             # job, plain and model.compile (about 7 minutes)
# Reports go to $OUT (default ./gpu-out):
#   step: generate-tests.txt (pytest -m cuda over generation), step-b1.txt / .json
#         (bench_decode_step.py, 1.24B, batch 1, four ways, --profile), step-b64.txt / .json
#         (batch 64, plain and compile)
#   job:  job-b1.txt / .json (48 prompts), job-b64.txt / .json (256 prompts):
#         bench_generate.py --parts job --ways graphrun,graphrun-compile, 1.24B
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
case "${1:-}" in
  step)
    python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_decode_attention.py \
        tests/test_generate_cuda.py > "$OUT/generate-tests.txt" 2>&1
    tail -1 "$OUT/generate-tests.txt"
    timeout 300 python3 benchmarks/bench_decode_step.py --layout 1.24B --batch 1 --profile \
        --json "$OUT/step-b1.json" > "$OUT/step-b1.txt" 2>&1 || echo "step, batch 1: failed"
    grep "^| \|^## " "$OUT/step-b1.txt"
    timeout 200 python3 benchmarks/bench_decode_step.py --layout 1.24B --batch 64 \
        --ways plain,compile --json "$OUT/step-b64.json" > "$OUT/step-b64.txt" 2>&1 \
        || echo "step, batch 64: failed"
    grep "^| \|^## " "$OUT/step-b64.txt"
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
