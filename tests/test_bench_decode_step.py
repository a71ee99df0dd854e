"""benchmarks/bench_decode_step.py on the CPU (--smoke): every way asked for gives a row with a
step time, the graphs it set up, completions that repeat across batches, and the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_smoke_run_times_each_plain_way_and_writes_its_rows(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode_step.py"),
                        "--smoke", "--json", str(out)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["way"] for r in rows] == ["plain", "plain-general"]
    for r in rows:
        assert r["step_ms"] > 0 and r["mbu"] is None and r["same_tokens"] is True
        assert {g["kind"] for g in r["graphs"]} == {"prefill", "decode"}
        assert r["weight_bytes"] > 0 and r["attention_failure"] is None
    assert "| plain-general |" in p.stdout


def test_an_unknown_way_is_one_usage_error():
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode_step.py"),
                        "--ways", "plain,fast"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and "--ways: unknown ['fast']" in p.stderr
