"""The runner under attack: hostile specs and inputs, output folders it does not own, forged
journals, concurrent runs, a full disk, signals at bad times, kill -9 at random points. Each
test asserts that nothing is lost and that the user gets one clear message, not a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from graphrun.errors import GraphrunError, OutputError, SpecError
from graphrun.spec_load import load_spec

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, cwd=None, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "graphrun", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_message(proc) -> str:
    """The CLI failed with one message and no traceback."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(("error: ", "graphrun: ")) or "invalid" in proc.stderr, \
        proc.stderr
    return proc.stderr


# ---- hostile YAML ------------------------------------------------------------------------------

def test_an_alias_bomb_is_refused_located_and_fast(write_spec, tmp_path):
    lines = ["a0: &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecError, match=r"bomb.yaml:1:\d+: a\d.*more than 100,000 values"):
        load_spec(path)


def test_a_self_referring_alias_is_refused_located(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("version: 1\nr: &r [*r]\n")
    with pytest.raises(SpecError, match=r"r.yaml:2:4: r\[0\]: an alias refers to a node that "
                                        "contains it"):
        load_spec(path)


def test_a_self_referring_alias_in_an_override_is_refused(write_spec):
    spec = write_spec()
    with pytest.raises(SpecError, match=r"--set model.args=\{a: &a \[\*a\]\}: model.args: .*"
                                        "cycle"):
        load_spec(spec, ["model.args={a: &a [*a]}"])
