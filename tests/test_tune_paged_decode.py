"""benchmarks/tune_paged_decode.py on the CPU: its reference check passes the reference's own
output and rejects a wrong output or a missing cache write; the configs it sweeps start with the
default and leave invalid ones out; in Triton's interpreter the kernel passes the check under
configs other than the default (smaller and larger tiles, more shares, one stage)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import tune_paged_decode as tune
from graphrun.models.causal import paged_attention
from graphrun.models.causal.paged_attention import KernelConfig

ROOT = Path(__file__).resolve().parents[1]


def case(dtype=torch.float32):
    return tune.make_case(3, 40, 4, 2, 16, 16, dtype, "cpu", seed=1)


def reference(c):
    return paged_attention.paged_decode_reference(**c)


def test_the_check_passes_the_reference_and_leaves_the_case_as_it_was():
    c = case()
    before = c["k_cache"].clone()
    assert tune.check(c, reference) is None
    assert torch.equal(c["k_cache"], before)


def test_the_check_rejects_a_wrong_output():
    def off_by_a_little(c):
        out = reference(c)
        out[1, 0, 2, 5] += 0.01
        return out

    assert "differs from the reference by 0.01" in tune.check(case(), off_by_a_little)
    assert "output shape" in tune.check(case(), lambda c: reference(c)[:2])
    assert "not finite" in tune.check(case(), lambda c: reference(c) * float("nan"))


def test_the_check_rejects_a_step_that_does_not_write_its_key():
    def forgetful(c):
        return reference({**c, "k_cache": c["k_cache"].clone()})

    assert tune.check(case(), forgetful) == ("k_cache differs from the reference's after the "
                                            "step's write")


def test_the_case_is_laid_out_as_a_decode_graphs():
    c = case(torch.bfloat16)
    assert c["q"].shape == (3, 4, 1, 16) and c["k_new"].shape == (3, 2, 1, 16)
    assert c["block_table"].shape == (3, -(-(40 + tune.SLACK) // 16))
    assert (c["seq_lens"] == 40).all() and (c["block_table"] > 0).all()
    assert c["block_table"].unique().numel() == c["block_table"].numel()  # no block shared


def test_the_sweep_starts_at_the_default_and_leaves_out_invalid_configs(capsys):
    a = argparse.Namespace(tiles=[32, 8, 64], warps=[4], stages=[2, 3], programs=[128],
                           max_splits=[16])
    got = tune.configs(a)
    assert got[0] == KernelConfig() and len(got) == len(set(got)) == 4
    assert {c.tile for c in got} == {32, 64}
    assert "tile 8" in capsys.readouterr().out


def test_without_a_gpu_it_says_so():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tune_paged_decode.py")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr


CONFIGS = [KernelConfig(tile=16, stages=1), KernelConfig(tile=64, warps=2),
           KernelConfig(programs=1024, max_splits=4), KernelConfig(programs=1, max_splits=1)]


def interpreted_failures() -> list[str]:
    return [f"{c}: {wrong}" for c in CONFIGS
            if (wrong := tune.check(tune.make_case(3, 70, 4, 2, 16, 16, torch.float32, "cpu"),
                                    tune.kernel(c)))]


def test_in_the_interpreter_the_kernel_passes_the_check_under_other_configs():
    pytest.importorskip("triton", reason="the paged decode kernel is written in Triton")
    from tests.triton_interpreter import run_interpreted

    p = run_interpreted("import tests.test_tune_paged_decode as t", "t.interpreted_failures()")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
