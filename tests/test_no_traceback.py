"""Issue 28's audit: bad specs, files and models met by run, validate, init, plan, bench and
sweep end in one message and a non-zero exit, never a traceback (without --debug): a model
that raises only in a larger bucket than the first one set up, a weights file or an input
file that is not what its name says."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from click.testing import CliRunner

from graphrun.cli.main import main

# Runs on short records; raises once its `t` is `fail_at` long or longer.
MODEL = '''\
import torch


class Model(torch.nn.Module):
    def __init__(self, fail_at=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.fail_at = fail_at

    def forward(self, x, t):
        if self.fail_at is not None and t.shape[1] >= self.fail_at:
            raise ValueError(f"cannot take {t.shape[1]} positions")
        return {"y": self.lin(x), "s": t.float() * 2}


def build(fail_at=None):
    torch.manual_seed(0)
    return Model(fail_at)
'''


@pytest.fixture
def spec_path(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"id": i, "x": [i, 1, 2, 3], "t": list(range(1 + i % 12))}) + "\n")
    spec = {
        "version": 1, "name": "audit", "device": "cpu", "model": {"target": "model.py:build"},
        "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32"},
                   "t": {"shape": ["batch", "seq"], "dtype": "int64", "range": [0, 100]}},
        "outputs": {"y": {"shape": ["batch", 3]}, "s": {"shape": ["batch", "seq"]}},
        "buckets": {"batch": [1, 4], "seq": [4, 8, 16]}, "capture": {"warmup_iters": 1},
        "data": {"path": "data.jsonl", "id_field": "id", "batch_size": 4},
        "output": {"dir": "out", "format": "jsonl"},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def fails_cleanly(*args, code: int | None = 2) -> str:
    """The command's output, having checked it ended with a message, not an exception."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code != 0 and (code is None or result.exit_code == code), result.output
    assert "Traceback" not in result.output
    return result.output


@pytest.mark.parametrize("verb", [["run"], ["validate", "--load"], ["bench", "--iters", "1"]])
def test_a_model_raising_in_a_larger_bucket_is_one_located_message(spec_path, verb):
    """The first call (the smallest bucket) works; seq 16's warm-up raises: the message names
    that bucket, the model's line and what to try."""
    out = fails_cleanly(verb[0], spec_path, *verb[1:], "--set", "model.args.fail_at=16",
                        code=None)
    # the first bucket of seq 16 met: run and validate set up batch 4 first, bench times batch 1
    assert re.search(r"bucket batch=[14],seq=16", out) and "ValueError: cannot take 16 positions" in out
    assert "model.py:12 in forward" in out
    # set up with a warm-up (validate --load, bench), the bucket's set-up fails; a CPU run
    # warms nothing up, so its first batch in that bucket does
    assert "leave them out of buckets" in out or (
        verb == ["run"] and "the model raised on the batch of 4 records" in out
        and "fix the model" in out), out


def test_a_weights_file_that_is_not_safetensors_is_one_message(spec_path):
    (spec_path.parent / "w.safetensors").write_bytes(b"\xff" * 64)
    out = fails_cleanly("run", spec_path, "--set", "model.weights=w.safetensors")
    assert "model.weights" in out and "cannot read it as a .safetensors file" in out


@pytest.mark.parametrize("verb", ["run", "plan"])
def test_an_npz_that_is_not_a_zip_is_one_message(spec_path, verb):
    (spec_path.parent / "data.npz").write_bytes(b"not a zip file" * 8)
    out = fails_cleanly(verb, spec_path, "--set", "data.path=data.npz")
    assert "data.npz: cannot read the .npz file: File is not a zip file" in out


def test_init_on_an_npz_that_is_not_a_zip_does_not_suggest_unpickling(spec_path):
    folder = spec_path.parent
    (folder / "data.npz").write_bytes(b"not a zip file" * 8)
    out = fails_cleanly("init", "--model", folder / "model.py:build", "--data",
                        folder / "data.npz", "-o", folder / "init.yaml")
    assert "File is not a zip file" in out and "pickle" not in out
    assert not (folder / "init.yaml").exists()


def test_a_sweep_whose_every_variant_fails_exits_non_zero(spec_path, tmp_path):
    """A grid key the spec refuses fails every variant: the table says why, the exit says
    the sweep gave nothing (it was 0)."""
    out = fails_cleanly("sweep", spec_path, "--grid", "data.batchsize=[2,4]", "--stop", "4",
                        "--out", tmp_path / "sw")
    assert out.count("unknown key 'batchsize'") >= 2 and "no variant completed" in out


def test_a_model_raising_in_a_bucket_set_up_on_first_use_is_one_message(spec_path,
                                                                          monkeypatch):
    """capture.lazy: the long records come after the read-ahead, so seq 16 is set up mid-run,
    where the model raises: one message naming the bucket, the batch and --resume."""
    monkeypatch.setenv("GRAPHRUN_READ_AHEAD_BYTES", "0")  # the first 4 batches held, no more
    with open(spec_path.parent / "late.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": i, "x": [i, 1, 2, 3], "t": [1] * (3 if i < 32 else 12)})
                    + "\n")
    out = fails_cleanly("run", spec_path, "--set", "data.path=late.jsonl", "--set",
                        "capture.lazy=true", "--set", "model.args.fail_at=16",
                        "--set", "capture.verify.eager=true")  # the CPU sets up a bucket so
    assert "bucket batch=4,seq=16: its setup on first use" in out and "--resume" in out
    assert "ValueError: cannot take 16 positions" in out and "model.py:12 in forward" in out
