#!/usr/bin/env bash
# The README's test command: install graphrun with its test extras, check the generated schemas,
# run every test that needs no GPU (GPU tests are marked `cuda` and skip themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure-torch.sh
python3 -m pip install -q --no-build-isolation -e ".[test]"
python3 -m graphrun schema --check
python3 -m pytest -q -p no:cacheprovider "$@"
