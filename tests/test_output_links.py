"""No file outside the output folder changes through a link planted in it: every file graphrun
writes or appends there is opened without following links, and --resume refuses a folder whose
own files are links, before writing anything."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

import graphrun
from graphrun.base.errors import GraphrunError, OutputError
from graphrun.base.nofollow import open_fd, open_file
from graphrun.spec.load import load_spec

MODEL = """\
import os

import torch


class Net(torch.nn.Module):
    def forward(self, x):
        if os.path.exists(os.environ["FAIL_FLAG"]) and bool((x[:, 0] == 13).any()):
            raise ValueError("record 13 fails while the flag file exists")
        return x * 2


def build():
    return Net()
"""


def failed_run(tmp_path: Path, fmt: str, monkeypatch) -> tuple[Path, Path]:
    """A run that failed at record 13 after committing the batches before it; (spec, out)."""
    flag = tmp_path / "fail"
    flag.write_text("")
    monkeypatch.setenv("FAIL_FLAG", str(flag))
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "data.jsonl").write_text("".join(f'{{"x": [{i}, 1]}}\n' for i in range(20)))
    spec = {"version": 1, "name": "links", "device": "cpu",
            "model": {"target": "model.py:build"},
            "inputs": {"x": {"shape": ["batch", 2]}}, "outputs": {"y": {"shape": ["batch", 2]}},
            "buckets": {"batch": [4]}, "capture": {"warmup_iters": 1},
            "data": {"path": "data.jsonl", "batch_size": 4},
            "output": {"dir": "out", "format": fmt, "rows_per_file": 4}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    with pytest.raises(GraphrunError, match="record 13 fails"):
        graphrun.run(load_spec(tmp_path / "spec.yaml"), out=out, overlap=False)
    flag.unlink()
    return tmp_path / "spec.yaml", out


NAMES = ["journal.jsonl", "rejects.jsonl", "latencies.jsonl", "manifest.json", "run.json",
         ".run.json.tmp", "manifest.json.tmp", "latencies.jsonl.tmp", "rejects.jsonl.tmp"]


@pytest.mark.parametrize("name", NAMES)
def test_resume_refuses_a_link_under_any_of_graphruns_names_and_changes_no_outside_file(
        tmp_path, monkeypatch, name):
    spec, out = failed_run(tmp_path, "jsonl", monkeypatch)
    outside = tmp_path / "users-file.txt"
    if (out / name).exists():  # the link points at a copy: its content matches
        outside.write_bytes((out / name).read_bytes())
        (out / name).unlink()
    else:
        outside.write_text("the user's own words\n")
    before = outside.read_bytes()
    (out / name).symlink_to(outside)
    with pytest.raises(OutputError, match=rf"{name} is a link .*remove the link"):
        graphrun.run(load_spec(spec), out=out, overlap=False, resume=True)
    assert outside.read_bytes() == before
    assert (out / name).is_symlink()


def test_a_fifo_under_graphruns_names_is_refused_not_waited_on(tmp_path, monkeypatch):
    # a fifo no one reads blocked the open for writing for good: --resume hung
    spec, out = failed_run(tmp_path, "jsonl", monkeypatch)
    (out / "latencies.jsonl").unlink()
    os.mkfifo(out / "latencies.jsonl")
    with pytest.raises(OutputError, match=r"latencies.jsonl is not a regular file .*remove it"):
        graphrun.run(load_spec(spec), out=out, overlap=False, resume=True)
    for mode in ("w", "ab"):
        with pytest.raises(OutputError, match="is not a regular file"):
            open_file(out / "latencies.jsonl", mode)


@pytest.mark.parametrize("fmt", ["jsonl", "npy", "parquet"])
def test_a_link_at_a_shards_temporary_name_is_refused_and_its_target_kept(tmp_path,
                                                                          monkeypatch, fmt):
    spec, out = failed_run(tmp_path, fmt, monkeypatch)
    outside = tmp_path / "users-file.bin"
    outside.write_bytes(b"keep me")
    committed = sorted(p.name for p in out.glob("part-*"))
    stem = f"part-{len({n.split('.')[0] for n in committed}):05d}"
    link = out / (f".{stem}.y.npy.tmp" if fmt == "npy" else f".{stem}.{fmt}.tmp")
    link.symlink_to(outside)
    with pytest.raises(OutputError):
        graphrun.run(load_spec(spec), out=out, overlap=False, resume=True)
    assert outside.read_bytes() == b"keep me"


@pytest.mark.parametrize("mode", ["w", "wb", "a", "ab", "r+b"])
def test_every_write_mode_refuses_a_symbolic_or_a_hard_link(tmp_path, mode):
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep me")
    (tmp_path / "sym").symlink_to(outside)
    os.link(outside, tmp_path / "hard")
    for name in ("sym", "hard"):
        with pytest.raises(OutputError, match=rf"{name} is a link"):
            open_file(tmp_path / name, mode)
    with pytest.raises(OutputError):
        open_fd(tmp_path / "sym", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert outside.read_bytes() == b"keep me"
    with open_file(tmp_path / "own", mode if "r" not in mode else "wb") as f:
        f.write(b"x" if "b" in mode else "x")
    assert (tmp_path / "own").read_bytes() == b"x"
