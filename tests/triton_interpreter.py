"""Triton's interpreter (TRITON_INTERPRET=1) made to compute as a GPU does where triton 3.6's
differs, for the tests that run graphrun's kernels on the CPU: import this and call
patch_interpreter() before a kernel's first call."""

from __future__ import annotations


def patch_interpreter() -> None:
    """Two fixes, for this process only:
    - a loop bound is read with int() of a one-element array, which numpy 2 refuses: read its
      one element instead;
    - float32 to bfloat16 truncates (a cast without a rounding mode), where a GPU rounds to
      nearest even: round with torch's conversion, which does."""
    import numpy as np
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interp

    original_patch = interp._patch_lang_tensor

    def patched(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched

    original_convert = interp._convert_float

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return rounded.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original_convert(data, src, dst, rounding_mode)

    interp._convert_float = convert


def run_interpreted(setup: str, failures: str):
    """A new process under Triton's interpreter (chosen at import), patched as above: runs
    `setup` (imports), then prints the list `failures` evaluates to and exits 1 if it holds
    any. The CompletedProcess, for the test to assert on."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import tests.triton_interpreter as ti; ti.patch_interpreter(); import sys; "
            f"{setup}; f = {failures}; print('\\n'.join(map(str, f))); sys.exit(1 if f else 0)")
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
