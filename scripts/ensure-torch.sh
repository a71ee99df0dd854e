# Sourced by demo.sh and test.sh: make sure torch is importable before installing graphrun,
# since a plain `torch>=2.4` requirement with no torch present pulls a multi-GB CUDA build.
# With no NVIDIA driver we ask for torch==2.13.0, the CPU build this project's machines carry
# (public PyPI's Linux wheel of that version is a CUDA build: there, set GRAPHRUN_TORCH, e.g.
# "torch --index-url https://download.pytorch.org/whl/cpu"); with one, pip's default build
# (CUDA). GRAPHRUN_TORCH: pip's arguments for something else.
if ! python3 -c "import torch" 2>/dev/null; then
  if [ -n "${GRAPHRUN_TORCH:-}" ]; then read -ra want <<< "$GRAPHRUN_TORCH"
  elif command -v nvidia-smi >/dev/null 2>&1; then want=("torch>=2.4")
  else want=("torch==2.13.0"); fi
  echo "installing ${want[*]}" >&2
  python3 -m pip install -q "${want[@]}"
fi
# The editable install builds without isolation, with this environment's setuptools: a fresh
# venv's is too old for it (Python 3.11's 65, without wheel's bdist_wheel) or missing (3.12).
if ! python3 -c "
import sys, setuptools
major, minor = (int(x) for x in setuptools.__version__.split('.')[:2])
if (major, minor) < (70, 1):
    import wheel  # setuptools before 70.1 builds wheels through it
sys.exit(major < 64)" 2>/dev/null; then
  echo "installing setuptools>=70.1 (the editable install's build backend)" >&2
  python3 -m pip install -q "setuptools>=70.1"
fi
