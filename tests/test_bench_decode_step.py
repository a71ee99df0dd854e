"""benchmarks/bench_decode_step.py on the CPU (--smoke): the anchor of matrix multiplies and
every engine way asked for give a row each with a step time; an engine way's row says which
graphs it set up and that its repeats, each from the same state, picked the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = str(ROOT / "benchmarks" / "bench_decode_step.py")


def bench(*args: str, cpu: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_the_smoke_run_times_the_anchor_and_each_engine_way_and_writes_its_rows(tmp_path):
    out = tmp_path / "rows.json"
    # matmuls asked last: it still runs first, every engine row's ratio needs it
    p = bench("--smoke", "--ways", "plain,plain-unfused,plain-general,matmuls", "--json",
              str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["way"] for r in rows] == ["matmuls", "plain", "plain-unfused", "plain-general"]
    anchor, *engine = rows
    # the tiny layout's 2 layers x (q, k, v, o, gate, up, down) and the lm_head
    assert anchor["matmuls"] == 2 * 7 + 1 and anchor["step_ms"] > 0
    assert anchor["graphs"][0]["kind"] == "matmuls" and anchor["x_matmuls"] == 1.0
    for r in engine:
        assert r["rows"] == 4 and r["kv_len"] == [5, 20]
        assert r["step_ms"] > 0 and r["mbu"] is None and r["same_tokens"] is True
        assert {g["kind"] for g in r["graphs"]} == {"prefill", "decode"}
        assert [g["shape"] for g in r["graphs"] if g["kind"] == "decode"] == [{"rows": 4}]
        assert r["weight_bytes"] > 0 and r["kv_bytes"] > 0 and r["attention_failure"] is None
        assert r["fused_failure"] is None
        assert r["x_matmuls"] == r["step_ms"] / anchor["step_ms"]
    assert "| plain-general |" in p.stdout and "| plain-unfused |" in p.stdout
    assert "x matmuls" in p.stdout and "kernels/step" not in p.stdout  # no --profile


def test_an_unknown_way_is_one_usage_error():
    p = bench("--ways", "plain,fast", cpu=False)
    assert p.returncode == 2 and "--ways: unknown ['fast']" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_bad_kv_length_is_one_usage_error():
    p = bench("--kv-len", "512,0", cpu=False)
    assert p.returncode == 2 and "give KV lengths of 1 or more" in p.stderr
    assert "Traceback" not in p.stderr
