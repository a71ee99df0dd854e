# Sourced by demo.sh and test.sh: make sure torch is importable before installing graphrun,
# since a plain `torch>=2.4` requirement with no torch present pulls a multi-GB CUDA build.
# With no NVIDIA driver we ask for torch==2.13.0, the CPU build this project's machines carry;
# with one, pip's default build (CUDA). Set GRAPHRUN_TORCH to ask for something else.
if ! python3 -c "import torch" 2>/dev/null; then
  if [ -n "${GRAPHRUN_TORCH:-}" ]; then want="$GRAPHRUN_TORCH"
  elif command -v nvidia-smi >/dev/null 2>&1; then want="torch>=2.4"
  else want="torch==2.13.0"; fi
  echo "installing $want" >&2
  python3 -m pip install -q "$want"
fi
