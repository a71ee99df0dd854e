"""benchmarks/bench_step_extras.py on the CPU (--smoke): a step time for every variant, and
its table and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_smoke_run_times_every_variant(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step_extras.py"),
                        "--smoke", "--json", str(out)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert list(rows)[0] == "greedy" and "all (Batch job)" in rows and len(rows) == 7
    assert all(r["step_ms"] > 0 and r["status"] == "eager" for r in rows.values())
    assert "all on vs sample + min_p" in p.stdout
