#!/usr/bin/env bash
# The README's first command: install graphrun and run the shipped decoder-step pipeline
# (on the GPU when there is one, else on the CPU), then show where the outputs went.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure-torch.sh
python3 -m pip install -q --no-build-isolation -e .
python3 -m graphrun run pipelines/decoder-step.yaml --overwrite "$@"
