#!/usr/bin/env bash
# The README's test command: install graphrun with its test extras, check the generated schemas,
# run every test that needs no GPU (GPU tests are marked `cuda` and skip themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure-torch.sh
python3 -m pip install -q --no-build-isolation -e ".[test]"
python3 -m graphrun schema --check
# one test process per core (pytest-xdist), at most 8; a test file stays on one process, so its
# module fixtures (a Ray cluster, a model folder) are made once; the files with slow tests go
# first (tests/conftest.py). GRAPHRUN_TEST_WORKERS=0: none.
workers=${GRAPHRUN_TEST_WORKERS:-$(python3 -c 'import os; print(min(8, len(os.sched_getaffinity(0))))')}
python3 -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
