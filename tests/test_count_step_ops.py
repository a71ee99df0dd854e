"""benchmarks/count_step_ops.py on the CPU: a decode step's end is the pick's two kernels and
the bookkeeping's one, and nothing of torch's but the step's own ops (a child process: the
script stands in for the kernels' module in the process it runs in)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.children import child_env

ROOT = Path(__file__).resolve().parent.parent


def counted(*args: str) -> dict[str, tuple[int, int]]:
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "count_step_ops.py"), *args],
                       capture_output=True, text=True, env=child_env(), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    out = {}
    for line in p.stdout.splitlines():
        if "torch ops that compute:" in line:
            words = line.split()
            out[words[0]] = (int(words[5]), int(words[8]))
    return out


def test_a_decode_steps_end_is_three_kernels_with_them_and_torchs_ops_without():
    with_kernels = counted("--kernels")
    assert with_kernels == {"greedy": (3, 3), "sample": (3, 3)}
    without = counted()
    assert without["greedy"][1] == without["sample"][1] == 0  # torch's ops do it all
    assert without["sample"][0] > without["greedy"][0] > 3
