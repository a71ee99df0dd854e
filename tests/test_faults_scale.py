"""Faults of a job of several workers (issue 28): a duplicate id whose copies fall in different
workers' shares is rejected as one process rejects it, and workers orphaned by a kill -9 of
the `--gpus` parent end (releasing the folder's lock) even when their own stop hangs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import graphrun
from graphrun.base.errors import OutputError
from graphrun.cli.main import main
from graphrun.write.folder import locked

# end to end: processes, real models, whole runs (`pytest -m "not slow"` leaves them out)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
N = 400  # shares of 200 records for 2 workers
DUPLICATES = {301: 1, 350: 349, 310: 5, 240: 12}  # ordinal -> the earlier ordinal whose id it has
BAD = {5, 77, 333}  # a short x

# The builtin mlp. While a file "slow" sits beside it, a launched worker streams a few
# batches, then waits for its parent's end; orphaned, it hangs at its run's end for good,
# ignoring signals: a stop that hangs, as one did in Completer.close waiting for a queue item
# that never came.
MODEL = '''\
import os
import time
from pathlib import Path

import torch

from graphrun.models.builtin.mlp import build_mlp

SLOW = Path(__file__).with_name("slow")
PARENT = int(os.environ.get("GRAPHRUN_JOB_PARENT") or 0)


def hang_when_orphaned():
    from graphrun.job.state import RunResources

    finish = RunResources.finish  # every run's end, however it stopped

    def stuck(self, *args, **kwargs):
        while PARENT and os.getppid() != PARENT:
            try:
                time.sleep(1)
            except BaseException:
                pass
        return finish(self, *args, **kwargs)

    RunResources.finish = stuck


class Scorer(torch.nn.Module):
    def __init__(self, **args):
        super().__init__()
        self.mlp = build_mlp(**args)
        self.slow = SLOW.exists()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        while self.slow and self.calls > 12 and os.getppid() == PARENT:
            time.sleep(0.01)  # mid-stream until the parent is gone
        return self.mlp(x)


def build(**args):
    if SLOW.exists():
        hang_when_orphaned()
    return Scorer(**args)
'''


def spec_dict(data: str) -> dict:
    return {
        "version": 1, "name": "faults-scale", "device": "cpu",
        "model": {"target": "model.py:build",
                  "args": {"in_features": 4, "hidden": 8, "layers": 2, "out_features": 3}},
        "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32", "finite": True}},
        "outputs": {"scores": {"shape": ["batch", 3]}},
        "buckets": {"batch": [1, 4, 8]},
        "capture": {"warmup_iters": 1},
        "data": {"path": data, "id_field": "id", "batch_size": 8, "on_bad_record": "skip"},
        "output": {"dir": "out", "format": "npy", "rows_per_file": 20},
    }


def record_ids(n: int, duplicates: dict) -> list:
    ids = [f"t{i:04d}" for i in range(n)]
    for later, earlier in duplicates.items():
        ids[later] = ids[earlier]
    return ids


def make_job(folder: Path, fmt: str, n: int = N, duplicates: dict = DUPLICATES) -> Path:
    """Records with ids t0000.. where each of `duplicates` repeats an earlier id: across the
    shares (1 at 301), within one (349 at 350), of a bad record (5, short: so 310 is no
    duplicate) and within share 0's range read by worker 1 (12 at 240)."""
    (folder / "model.py").write_text(MODEL)
    ids = record_ids(n, duplicates)
    x = np.array([[((i * 7 + j) % 13) / 4 - 1.5 for j in range(4)] for i in range(n)],
                 np.float32)
    if fmt == "jsonl":
        with open(folder / "data.jsonl", "w") as f:
            for i in range(n):
                row = x[i].tolist()
                f.write(json.dumps({"id": ids[i], "x": row[:3] if i in BAD else row}) + "\n")
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [x[i].tolist()[:3] if i in BAD else x[i].tolist() for i in range(n)]
        pq.write_table(pa.table({"id": ids, "x": rows}), folder / "data.parquet",
                       row_group_size=64)
    else:
        x[sorted(BAD), 0] = np.nan  # bad: NaN with finite: true
        np.savez(folder / "data.npz", x=x, id=np.array([int(i[1:]) for i in ids], np.int64))
    path = folder / f"{fmt}.yaml"
    path.write_text(yaml.safe_dump(spec_dict(f"data.{fmt}"), sort_keys=False))
    return path


def cli(*args, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "graphrun", "run", *map(str, args)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, rc: int = 0) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == rc, out + err
    return err


def run_here(*args) -> None:
    """`graphrun run ARGS`, which must succeed, as the command line runs it but in this
    process (CliRunner: no interpreter start and torch import of its own for the --gpus
    parent; its workers are processes all the same): where the parent's being a process is
    not what a test is about."""
    result = CliRunner().invoke(main, ["run", *map(str, args)])
    assert result.exit_code == 0 and result.exception is None, result.output


def records(out: Path) -> tuple[list, np.ndarray]:
    ids = [i for f in sorted(out.glob("part-*.ids.npy")) for i in np.load(f).tolist()]
    return ids, np.concatenate([np.load(f) for f in sorted(out.glob("part-*.scores.npy"))])


def check_equals_one_process(out: Path, one: Path) -> None:
    ids, scores = records(out)
    want_ids, want_scores = records(one)
    assert ids == want_ids and len(set(ids)) == len(ids)
    eps = np.finfo(np.float32).eps  # as tests/test_scale_local.py: another bucket's rounding
    np.testing.assert_allclose(scores, want_scores, rtol=16 * eps, atol=16 * eps)
    assert (out / "rejects.jsonl").read_bytes() == (one / "rejects.jsonl").read_bytes()
    got = json.loads((out / "manifest.json").read_text())["totals"]
    want = json.loads((one / "manifest.json").read_text())["totals"]
    for key in ("records_in", "records_out", "records_rejected"):
        assert got[key] == want[key], key


def one_process(spec: Path, out: Path) -> list[dict]:
    m = graphrun.run(graphrun.load_spec(spec), out=out)
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    # 3 duplicates (310's first copy was bad) and 3 bad records
    assert m.totals.records_rejected == 6 and m.totals.records_out == N - 6
    assert sorted(r["index"] for r in rejects if "duplicate" in r["reason"]) == [240, 301, 350]
    return rejects


# ---- duplicate ids across workers' shares ----------------------------------------------------

@pytest.mark.parametrize("fmt", ["jsonl", "npz", "parquet"])
def test_gpus_2_rejects_a_duplicate_whose_copies_are_in_different_shares(tmp_path, fmt):
    spec = make_job(tmp_path, fmt)
    one_process(spec, tmp_path / "one")
    out = tmp_path / "job"
    run_here(spec, "--gpus", "2", "--out", out, "-q")
    m = json.loads((out / "manifest.json").read_text())
    assert [w["slice"] for w in m["workers"]] == [[0, 200], [200, N]]
    check_equals_one_process(out, tmp_path / "one")


def test_torchrun_workers_reject_a_duplicate_across_shares(tmp_path):
    spec = make_job(tmp_path, "jsonl")
    one_process(spec, tmp_path / "one")
    out = tmp_path / "job"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [cli(spec, "--out", out, "-q",
                 env=dict(os.environ, RANK=str(k), LOCAL_RANK=str(k), WORLD_SIZE="2",
                          LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for k in range(2)]
    for p in procs:
        finish(p)
    check_equals_one_process(out, tmp_path / "one")


def test_a_resumed_run_still_rejects_a_duplicate_of_a_record_before_its_restart(tmp_path):
    # One process resumed past the first copy: the ids read before the restart count too.
    spec = make_job(tmp_path, "jsonl")
    one_process(spec, tmp_path / "one")
    out = tmp_path / "out"
    graphrun.run(graphrun.load_spec(spec), out=out)
    lines = (out / "journal.jsonl").read_bytes().splitlines(keepends=True)
    (out / "journal.jsonl").write_bytes(b"".join(lines[:12]))  # committed up to about 250
    (out / "manifest.json").unlink()
    graphrun.run(graphrun.load_spec(spec), out=out, resume=True)
    check_equals_one_process(out, tmp_path / "one")


# ---- orphaned workers end when the --gpus parent is killed ---------------------------------

def job_workers(parent: int) -> list[int]:
    """The pids of the workers the --gpus parent started (from their environment)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"GRAPHRUN_JOB_PARENT={parent}".encode() in env and entry.name.isdigit():
            pids.append(int(entry.name))
    return pids


def running(pid: int) -> bool:
    """Not ended (an ended process whose new parent does not reap it is a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


# Loaded at the start of each process given it on PYTHONPATH: in a launched worker, the
# watchdog's grace for a hung stop is 1 s rather than the 5 s of graphrun's default. How long
# it waits is no part of what the test checks (that it then ends the process); it is 4 s of
# the test's wall time.
SHORT_GRACE = """\
import os

if os.environ.get("GRAPHRUN_JOB_PARENT"):
    from graphrun.scale.local import world

    world.ORPHAN_GRACE_S = 1.0
"""


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_workers_end_when_the_parent_is_killed_and_resume_completes(tmp_path):
    n = 1600
    spec = make_job(tmp_path, "jsonl", n=n, duplicates={})
    clean = tmp_path / "clean"
    run_here(spec, "--gpus", "2", "--out", clean, "-q")
    (tmp_path / "slow").write_text("")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SHORT_GRACE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = tmp_path / "job"
    parent = cli(spec, "--gpus", "2", "--out", out, "-q", env=env)
    deadline = time.monotonic() + 120
    journals = [out / f"workers/rank-{k}/journal.jsonl" for k in range(2)]
    while not all(j.exists() and j.read_bytes().count(b"\n") >= 1 for j in journals):
        assert parent.poll() is None, parent.communicate()
        assert time.monotonic() < deadline, "the workers made no progress"
        time.sleep(0.02)
    workers = job_workers(parent.pid)
    assert len(workers) == 2
    parent.kill()
    parent.communicate()
    t0 = time.monotonic()
    while any(running(pid) for pid in workers) and time.monotonic() - t0 < 20:
        time.sleep(0.1)
    still = [pid for pid in workers if running(pid)]
    for pid in still:  # the test's own cleanup: it must not leave them behind
        os.kill(pid, signal.SIGKILL)
    assert not still, "orphaned workers did not end"
    assert len(list(out.glob("part-*.ids.npy"))) < len(list(clean.glob("part-*.ids.npy")))
    # and the folder's lock is free: a worker's main thread can show as ended (a zombie)
    # while the rest of it still exits, holding the lock a moment longer
    while True:
        try:
            with locked(out):
                break
        except OutputError:
            assert time.monotonic() - t0 < 20, "the orphaned workers' lock was not released"
            time.sleep(0.05)

    (tmp_path / "slow").unlink()
    run_here(spec, "--gpus", "2", "--out", out, "-q", "--resume")
    names = sorted(p.name for p in clean.glob("part-*"))
    assert sorted(p.name for p in out.glob("part-*")) == names
    for name in names:
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name
    assert (out / "rejects.jsonl").read_bytes() == (clean / "rejects.jsonl").read_bytes()
    totals = json.loads((out / "manifest.json").read_text())["totals"]
    assert totals["records_in"] == n == totals["records_out"] + totals["records_rejected"]
