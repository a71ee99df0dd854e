"""Faults in the output folder (issue 28): --resume never removes what a user put there, a
failed write to rejects.jsonl leaves a resumable folder, and a committed file changed in place
is caught. Each test stages its fault itself on a small run of the builtin mlp."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main
from graphrun.base.errors import OutputError
from graphrun.write.journal import read_journal

N = 400
ROWS_PER_FILE = 40  # 10 shards, about 8 rejects


def spec_dict() -> dict:
    return {
        "version": 1, "name": "faults", "device": "cpu",
        "model": {"builtin": "mlp",
                  "args": {"in_features": 4, "hidden": 8, "layers": 2, "out_features": 3}},
        "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32", "finite": True}},
        "outputs": {"scores": {"shape": ["batch", 3]}},
        "buckets": {"batch": [1, 4, 16]},
        "capture": {"warmup_iters": 1},
        "data": {"path": "data.jsonl", "id_field": "id", "batch_size": 16,
                 "on_bad_record": "skip"},
        "output": {"dir": "out", "format": "npy", "rows_per_file": ROWS_PER_FILE},
    }


def make_job(folder: Path, n: int = N) -> Path:
    """n records; every 50th (from 7) has a short x, so it is rejected."""
    with open(folder / "data.jsonl", "w") as f:
        for i in range(n):
            x = [((i * 7 + j) % 13) / 4 - 1.5 for j in range(4)]
            f.write(json.dumps({"id": i, "x": x[:3] if i % 50 == 7 else x}) + "\n")
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec_dict(), sort_keys=False))
    return path


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def snapshot(folder: Path) -> dict:
    """Every entry under folder: a file's bytes, a symlink's target, a folder's marker."""
    out = {}
    for p in sorted(folder.rglob("*")):
        key = str(p.relative_to(folder))
        out[key] = (("link", os.readlink(p)) if p.is_symlink() else
                    ("dir",) if p.is_dir() else p.read_bytes())
    return out


def outputs(out: Path) -> tuple[list[int], np.ndarray]:
    ids = [i for f in sorted(out.glob("part-*.ids.npy")) for i in np.load(f).tolist()]
    scores = np.concatenate([np.load(f) for f in sorted(out.glob("part-*.scores.npy"))])
    return ids, scores


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def check_equals_clean(out: Path, clean: Path) -> None:
    ids, scores = outputs(out)
    want_ids, want_scores = outputs(clean)
    assert ids == want_ids and len(set(ids)) == len(ids)
    np.testing.assert_array_equal(scores, want_scores)
    assert (out / "rejects.jsonl").read_bytes() == (clean / "rejects.jsonl").read_bytes()
    got, want = manifest(out)["totals"], manifest(clean)["totals"]
    assert got["records_in"] == N == got["records_out"] + got["records_rejected"]
    for key in ("records_in", "records_out", "records_rejected"):
        assert got[key] == want[key], key
    check_rejects_hashed(out)


def check_rejects_hashed(out: Path) -> None:
    """Each journal line holds the sha256 of rejects.jsonl's bytes it commits."""
    import hashlib

    data = (out / "rejects.jsonl").read_bytes()
    for raw in (out / "journal.jsonl").read_text().splitlines():
        line = json.loads(raw)
        assert line["rejects_sha256"] == hashlib.sha256(data[:line["rejects_bytes"]]).hexdigest()


@pytest.fixture
def job(tmp_path):
    spec = make_job(tmp_path)
    clean = tmp_path / "clean"
    m = graphrun.run(graphrun.load_spec(spec), out=clean)
    assert m.status == "completed" and m.totals.records_rejected == 8
    return spec


def interrupted_after(out: Path, clean: Path, shards: int) -> None:
    """out: what a run killed after committing `shards` shards leaves: the clean run's files,
    its journal cut to those shards, later shards not yet there, no manifest."""
    out.mkdir()
    for p in clean.iterdir():
        (out / p.name).write_bytes(p.read_bytes())
    lines = (out / "journal.jsonl").read_bytes().splitlines(keepends=True)
    (out / "journal.jsonl").write_bytes(b"".join(lines[:shards]))
    (out / "manifest.json").unlink()
    for p in out.glob("part-*"):
        if int(p.name[5:10]) >= shards:
            p.unlink()


# ---- --resume removes only regular files graphrun wrote -----------------------------------

@pytest.mark.parametrize("kind", ["folder", "symlink"])
def test_resume_never_removes_a_users_entry_shaped_like_a_shard(job, tmp_path, kind):
    out = tmp_path / "out"
    interrupted_after(out, tmp_path / "clean", shards=3)
    mine = out / "part-00007.scores.npy"  # a number --resume would clear as unfinished work
    if kind == "folder":
        mine.mkdir()
        (mine / "thesis.txt").write_text("mine")
    else:
        (tmp_path / "elsewhere.npy").write_text("mine")
        mine.symlink_to(tmp_path / "elsewhere.npy")
    before = snapshot(out)
    result = cli("run", job, "-q", "--resume")
    assert result.exit_code == 2, result.output
    assert "part-00007.scores.npy" in result.output and "move" in result.output
    assert f"a {kind}" in result.output and "Traceback" not in result.output
    assert snapshot(out) == before  # nothing removed, nothing written
    assert (tmp_path / "elsewhere.npy").exists() or kind == "folder"

    (out / "part-00007.scores.npy").rename(tmp_path / "moved")
    result = cli("run", job, "-q", "--resume")
    assert result.exit_code == 0, result.output
    check_equals_clean(out, tmp_path / "clean")


def test_resume_with_nothing_committed_and_a_users_shard_shaped_folder(job, tmp_path):
    # Nothing committed: --resume used to go on to a fresh writer that told the user to
    # "pass --resume", which they had passed.
    out = tmp_path / "out"
    interrupted_after(out, tmp_path / "clean", shards=0)
    (out / "journal.jsonl").unlink()
    (out / ".part-00000.ids.npy.tmp").mkdir()
    before = snapshot(out)
    result = cli("run", job, "-q", "--resume")
    assert result.exit_code == 2
    assert ".part-00000.ids.npy.tmp" in result.output and "a folder" in result.output
    assert "pass --resume" not in result.output
    assert snapshot(out) == before


def test_a_workers_restore_refuses_a_users_folder_too(tmp_path):
    # The defense below prepare_out_dir: restore itself (a job's worker reaches it with its
    # shards in the job's folder) never removes a folder.
    from graphrun.write.journal import ResumePoint, restore

    (tmp_path / "part-00002.ids.npy").mkdir()
    point = ResumePoint(next_index=0, shard=0, rows=0, rejects=0, rejects_bytes=0)
    with pytest.raises(OutputError, match="part-00002.ids.npy, a folder"):
        restore(tmp_path, point, ["ids.npy"])
    assert (tmp_path / "part-00002.ids.npy").is_dir()


# ---- a failed append to rejects.jsonl fails its commit -----------------------------------

class FailingFile:
    """rejects.jsonl opened by the writer: its `fail_at`-th write puts half its bytes on disk
    (a torn tail) and then fails as a full disk does; the others pass through."""

    def __init__(self, real, fail_at: int, err: int):
        self.real, self.fail_at, self.err, self.writes = real, fail_at, err, 0

    def write(self, data) -> int:
        self.writes += 1
        if self.writes == self.fail_at:
            self.real.write(bytes(data)[:len(data) // 2])
            raise OSError(self.err, os.strerror(self.err))
        return self.real.write(data)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("fail_at, err, overlap", [
    (1, errno.ENOSPC, False), (3, errno.ENOSPC, False), (6, errno.ENOSPC, False),
    (1, errno.EIO, False), (3, errno.EIO, False), (6, errno.EIO, False),
    (3, errno.ENOSPC, True), (6, errno.EIO, True)])  # overlapped: written on the completer
def test_a_failed_rejects_write_fails_the_run_and_resume_accounts_for_every_record(
        job, tmp_path, fail_at, err, overlap):
    out = tmp_path / "out"
    spec = graphrun.load_spec(job)

    from functools import partial

    from graphrun.base.nofollow import open_file
    from graphrun.job.parts import JobParts
    from graphrun.write.shards import DiskSteps, ShardWriter

    def failing_open(path, *args, **kwargs):
        return FailingFile(open_file(path, *args, **kwargs), fail_at, err)

    writer = partial(ShardWriter, disk=DiskSteps(open_rejects=failing_open))
    with pytest.raises(OutputError, match="rejects.jsonl|No space|Input/output"):
        graphrun.run(spec, out=out, overlap=overlap, parts=JobParts(writer=writer))
    assert manifest(out)["status"] == "failed"
    point = read_journal(out)  # the journal passes its own checks: resumable
    m = manifest(out)["totals"]
    if point is not None:
        assert m["records_out"] == point.rows and m["records_rejected"] == point.rejects

    m = graphrun.run(spec, out=out, resume=True)
    assert m.status == "completed"
    check_equals_clean(out, tmp_path / "clean")
    lines = (out / "rejects.jsonl").read_text().splitlines()
    assert len(lines) == len({json.loads(x)["index"] for x in lines}) == 8  # each once


# ---- --resume checks the committed files' hashes ---------------------------------------

def flip_a_byte(path: Path, at: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))  # same size: only a hash tells


def test_resume_of_a_completed_run_catches_a_shard_changed_in_place(job, tmp_path):
    clean = tmp_path / "clean"
    before = snapshot(clean)
    flip_a_byte(clean / "part-00004.scores.npy")
    result = cli("run", job, "-q", "--resume", "--out", clean)
    assert result.exit_code == 2, result.output
    assert "part-00004.scores.npy" in result.output and "sha256" in result.output
    assert "already complete" not in result.output and "--overwrite" in result.output
    assert snapshot(clean).keys() == before.keys()  # nothing removed or added


@pytest.mark.parametrize("completed", [True, False], ids=["completed", "interrupted"])
def test_resume_catches_an_edited_committed_reject(job, tmp_path, completed):
    out = tmp_path / "clean"
    if not completed:
        out = tmp_path / "out"
        interrupted_after(out, tmp_path / "clean", shards=5)
    rejects = out / "rejects.jsonl"
    text = rejects.read_text()
    assert '"id": 7' in text.splitlines()[0]  # committed with the first shard
    rejects.write_text(text.replace('"id": 7', '"id": 9', 1))  # same size
    result = cli("run", job, "-q", "--resume", "--out", out)
    assert result.exit_code == 2, result.output
    assert "rejects.jsonl" in result.output and "edited" in result.output
    assert rejects.read_text() == text.replace('"id": 7', '"id": 9', 1)  # kept as it is


def test_journal_lines_record_the_committed_rejects_sha256(job, tmp_path):
    check_rejects_hashed(tmp_path / "clean")
