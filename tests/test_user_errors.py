"""A new user's mistakes (issue 20): each meets one clear message that names where and what
to do, and every remedy a message prints works."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import graphrun
from graphrun.cli import main

# A model of the user's own: a linear scorer that checks its input inside forward (raising
# for a record whose first value is 50 while the file "broken" sits beside it), and can be
# made to mix the rows of its batch, or return the wrong number of rows.
MODEL = '''\
from pathlib import Path

import torch

BROKEN = Path(__file__).with_name("broken")


class Scorer(torch.nn.Module):
    def __init__(self, mix=False, rows=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.mix, self.rows = mix, rows

    def forward(self, x):
        if BROKEN.exists() and bool((x[:, 0] == 50).any()):
            raise ValueError("record with x[0] == 50 is not allowed")
        y = self.lin(x)
        if self.mix:  # every row sees the batch's mean: padded rows move real ones
            y = y + x.mean(0, keepdim=True)[:, :3]
        if self.rows is not None:
            y = y[: self.rows]
        return y


def build(**args):
    return Scorer(**args)
'''


def spec_dict(**data) -> dict:
    return {
        "version": 1, "name": "user", "device": "cpu",
        "model": {"target": "model.py:build"},
        "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32"}},
        "outputs": {"y": {"shape": ["batch", 3]}},
        "buckets": {"batch": [1, 4, 8]},
        "capture": {"warmup_iters": 1},
        "data": {"path": "data.jsonl", "id_field": "id", "batch_size": 8, **data},
        "output": {"dir": "out", "format": "npy", "rows_per_file": 16},
    }


def make_job(folder: Path, spec: dict | None = None, n: int = 100, broken: bool = False) -> Path:
    (folder / "model.py").write_text(MODEL)
    (folder / "data.jsonl").write_text("".join(
        json.dumps({"id": f"r{i}", "x": [i, 1, 2, 3]}) + "\n" for i in range(n)))
    if broken:
        (folder / "broken").touch()
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec or spec_dict(), sort_keys=False))
    return path


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def ids_written(out: Path) -> list[str]:
    import numpy as np
    return [str(i) for f in sorted(out.glob("part-*.ids.npy")) for i in np.load(f).tolist()]


# ---- 1. a model that raises partway through a run --------------------------------------------

@pytest.mark.parametrize("on_bad_record", ["error", "skip"])
@pytest.mark.parametrize("overlap", ["on", "off"])
def test_a_model_raising_mid_run_names_the_batch_and_resume_continues(
        tmp_path, monkeypatch, on_bad_record, overlap):
    monkeypatch.setenv("GRAPHRUN_OVERLAP", overlap)
    spec = make_job(tmp_path, spec_dict(on_bad_record=on_bad_record), broken=True)
    result = cli("run", spec, "-q")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert "Traceback" not in result.output and len(lines) <= 4, result.output
    # records 48..55 are the batch that holds record 50 (batches of 8)
    assert lines[0].startswith("error: the model raised on the batch of 8 records from "
                               "data.jsonl:49 (ids r48, r49, r50, ... r55) "
                               "in bucket batch=8: ValueError: record with x[0] == 50")
    assert f"at {tmp_path / 'model.py'}:16 in forward" in lines[1]
    out = tmp_path / "out"
    m = manifest(out)
    assert m["status"] == "failed" and m["error"] == result.output.strip()[len("error: "):]
    assert ids_written(out) == [f"r{i}" for i in range(48)]  # all before the batch, committed
    (tmp_path / "broken").unlink()  # the model fixed
    result = cli("run", spec, "-q", "--resume")
    assert result.exit_code == 0, result.output
    assert ids_written(out) == [f"r{i}" for i in range(100)]
    assert manifest(out)["status"] == "completed"
