"""Crashes, interrupts and resume (issue 6): nothing lost, nothing repeated, nothing clobbered.

A real `python -m graphrun run` is killed with SIGKILL at random points or stopped with
SIGINT/SIGTERM; `--resume` must then give outputs equal to a clean run's: the same ids and
values, no duplicates, no gaps, the same rejects.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main
from graphrun.base.errors import ModelError
from graphrun.write.journal import read_journal, sha256_file

# end to end: processes, real models, whole runs (`pytest -m "not slow"` leaves them out)
pytestmark = pytest.mark.slow

N_RECORDS = 1600
ROWS_PER_FILE = 50  # 32 shards: many commit points to kill between

# The builtin mlp, wrapped so that a test can make it send SIGINT twice to its own process in
# the middle of the run, or crash there (only while a trigger file exists; the spec stays the
# same, so the run can be resumed).
MODEL = '''\
import os
import signal
import time
from pathlib import Path

import torch

from graphrun.models.builtin.mlp import build_mlp

TRIGGER = Path(__file__).with_name("send-two-sigints")
CRASH = Path(__file__).with_name("crash")
SLOW_COMMITS = Path(__file__).with_name("slow-commits")


def slow_commits():
    """Each file takes 0-40 ms more to commit, at random: several shards are in flight at
    once and finish out of order, so a kill lands between any two steps of their commits."""
    import random

    from graphrun.write import shards as write

    sha256 = write.sha256_file

    def slow(path):
        time.sleep(random.uniform(0, 0.04))
        return sha256(path)

    write.sha256_file = slow


class Scorer(torch.nn.Module):
    def __init__(self, **args):
        super().__init__()
        self.mlp = build_mlp(**args)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 40 and TRIGGER.exists():  # well past setup, well before the end
            TRIGGER.unlink()
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs here
        if self.calls == 40 and CRASH.exists():
            raise RuntimeError("the model broke at call 40")
        return self.mlp(x)


class Tagged(Scorer):
    """Also returns the size of the bucket each record ran in."""

    def forward(self, x):
        # x: [B, 4] -> scores [B, 3], bucket [B] (= B)
        return {"scores": super().forward(x),
                "bucket": torch.full((x.shape[0],), x.shape[0], dtype=torch.float32)}


def build(**args):
    if SLOW_COMMITS.exists():
        slow_commits()
    return Scorer(**args)


def build_tagged(**args):
    return Tagged(**args)
'''


def spec_dict(*, target: str = "model.py:build") -> dict:
    return {
        "version": 1, "name": "recovery", "device": "cpu",
        "model": {"target": target,
                  "args": {"in_features": 4, "hidden": 8, "layers": 2, "out_features": 3}},
        "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32", "finite": True}},
        "outputs": {"scores": {"shape": ["batch", 3]}},
        "buckets": {"batch": [1, 4, 16]},
        "capture": {"warmup_iters": 1},
        "data": {"path": "data.jsonl", "id_field": "id", "batch_size": 16,
                 "on_bad_record": "skip"},
        "output": {"dir": "out", "format": "npy", "rows_per_file": ROWS_PER_FILE},
    }


def write_data(path: Path, n: int, seed: int = 0) -> None:
    """n records, about 1.5% of them bad (a short x, or a NaN with finite: true)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            x = [round(rng.uniform(-2, 2), 4) for _ in range(4)]
            if i % 97 == 13:
                x = x[:3]
            if i % 211 == 7:
                x[0] = float("nan")  # json writes NaN
            f.write(json.dumps({"id": i, "x": x}) + "\n")


def good_ids(n: int) -> list[int]:
    return [i for i in range(n) if i % 97 != 13 and i % 211 != 7]


def make_job(folder: Path, n: int = N_RECORDS, spec: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(MODEL)
    write_data(folder / "data.jsonl", n)
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec or spec_dict(), sort_keys=False))
    return path


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The spec and a clean, uninterrupted run of it to compare against."""
    folder = tmp_path_factory.mktemp("recovery")
    spec = make_job(folder)
    clean = folder / "clean"
    manifest = graphrun.run(graphrun.load_spec(spec), out=clean)
    assert manifest.status == "completed" and manifest.totals.records_rejected > 20
    return SimpleNamespace(folder=folder, spec=spec, clean=clean, manifest=manifest)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def start(spec: Path, out: Path, *extra: str, overlap: bool | None = None) -> subprocess.Popen:
    """`graphrun run` in a subprocess; overlap forces the overlapped or serial stream (the
    CPU's default is serial; a GPU's is overlapped)."""
    env = dict(os.environ)
    if overlap is not None:
        env["GRAPHRUN_OVERLAP"] = "on" if overlap else "off"
    return subprocess.Popen([sys.executable, "-m", "graphrun", "run", str(spec), "--out",
                             str(out), "-q", *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def committed(out: Path) -> int:
    """Shards committed so far: whole lines of the journal."""
    try:
        return (out / "journal.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_until(proc: subprocess.Popen, ready, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before the test could stop it:\n"
                        f"{proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the run made no progress")
        time.sleep(0.002)


def kill_9_after(proc: subprocess.Popen, out: Path, shards: int, pause: float) -> None:
    """SIGKILL the run `pause` seconds after its journal holds `shards` shards."""
    wait_until(proc, lambda: committed(out) >= shards)
    time.sleep(pause)
    proc.kill()
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def outputs(out: Path) -> tuple[list[int], np.ndarray]:
    """All shards concatenated in order: ids [n] and scores [n, 3]."""
    ids = [i for f in sorted(out.glob("part-*.ids.npy")) for i in np.load(f).tolist()]
    scores = np.concatenate([np.load(f) for f in sorted(out.glob("part-*.scores.npy"))])
    return ids, scores


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def check_committed_files_intact(out: Path) -> None:
    point = read_journal(out)
    for info in point.files if point else []:
        path = out / info.path
        assert path.stat().st_size == info.bytes and sha256_file(path) == info.sha256, info


def check_equals_clean(out: Path, job, *, same_shards: bool = True) -> None:
    """Outputs equal a clean run's bit for bit; with same_shards, shard for shard too (a failed
    run commits its partial last shard, so after it the shard layout differs)."""
    ids, scores = outputs(out)
    clean_ids, clean_scores = outputs(job.clean)
    assert len(ids) == len(set(ids)), "duplicate records"
    assert ids == clean_ids, "records missing or out of order"
    # Bitwise equal: a resumed run re-reads from the start of the batch that held the last
    # committed row, so every record is batched, and padded to a bucket, as in the clean run.
    np.testing.assert_array_equal(scores, clean_scores)
    shards = sorted(p.name for p in out.glob("part-*"))
    if same_shards:
        assert shards == sorted(p.name for p in job.clean.glob("part-*"))
        for name in shards:
            assert (out / name).read_bytes() == (job.clean / name).read_bytes(), name
    assert (out / "rejects.jsonl").read_bytes() == (job.clean / "rejects.jsonl").read_bytes()
    got, want = manifest(out), manifest(job.clean)
    assert got["status"] == "completed"
    for key in ("records_in", "records_out", "records_rejected"):
        assert got["totals"][key] == want["totals"][key], key
    t = got["totals"]
    assert t["records_in"] == N_RECORDS == t["records_out"] + t["records_rejected"]
    assert sum(f["rows"] for f in got["files"] if f["path"].endswith(".ids.npy")) == len(ids)
    check_committed_files_intact(out)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill_9_at_random_points_then_resume_equals_a_clean_run(job, tmp_path, seed):
    rng = random.Random(seed)
    out = tmp_path / "out"
    for attempt in range(1 + seed % 2):  # seed 1 and 3 are killed twice (the resume too)
        proc = start(job.spec, out, *(["--resume"] if attempt else []))
        k = committed(out) + rng.randint(0, 8)
        if k == 0:  # before the first commit: during setup or the first shard
            wait_until(proc, lambda: (out / "run.json").exists())
        else:
            wait_until(proc, lambda: committed(out) >= k)
        time.sleep(rng.uniform(0, 0.03))  # between commits, mostly
        proc.kill()
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        check_committed_files_intact(out)
    before = read_journal(out)

    result = cli("run", job.spec, "--out", out, "--resume", "-q")
    assert result.exit_code == 0, result.output
    check_equals_clean(out, job)
    # A kill between commits repeats no shard: the resumed run writes the same shards.
    clean_files = [(f["path"], f["rows"]) for f in manifest(job.clean)["files"]]
    assert [(f["path"], f["rows"]) for f in manifest(out)["files"]] == clean_files
    assert sorted(p.name for p in out.glob("part-*")) == sorted(p for p, _ in clean_files)
    assert not list(out.glob(".*.tmp"))
    assert manifest(out)["resumed_from"] == (before.next_index if before else None)


@pytest.mark.parametrize("seed", [4, 5])
def test_kill_9_with_commits_in_flight_then_resume_equals_a_clean_run(job, tmp_path, seed):
    """Shards commit in the background, several at once: a kill -9 may leave later shards
    renamed but not journaled, or journaled only up to an earlier shard still hashing."""
    rng = random.Random(seed)
    out = tmp_path / "out"
    (job.folder / "slow-commits").touch()
    try:
        k = rng.randint(1, 6)
        kill_9_after(start(job.spec, out), out, k, rng.uniform(0, 0.05))
    finally:
        (job.folder / "slow-commits").unlink()
    check_committed_files_intact(out)
    assert committed(out) >= k
    result = cli("run", job.spec, "--out", out, "--resume", "-q")
    assert result.exit_code == 0, result.output
    check_equals_clean(out, job)
    assert not list(out.glob(".*.tmp"))


@pytest.mark.parametrize("seed", [6, 7])
def test_kill_9_of_an_overlapped_run_then_resume_equals_a_clean_run(job, tmp_path, seed,
                                                                     monkeypatch):
    """The GPU's default path (stager, launcher and completer threads), forced on the CPU."""
    rng = random.Random(seed)
    out = tmp_path / "out"
    kill_9_after(start(job.spec, out, overlap=True), out, rng.randint(1, 8),
                 rng.uniform(0, 0.03))
    check_committed_files_intact(out)
    monkeypatch.setenv("GRAPHRUN_OVERLAP", "on")
    result = cli("run", job.spec, "--out", out, "--resume", "-q")
    assert result.exit_code == 0, result.output
    check_equals_clean(out, job)
    assert manifest(out)["totals"]["overlapped"] is True


@pytest.mark.parametrize("seed", [8, 9])
def test_kill_9_while_rows_are_written_by_the_pool_then_resume_equals_a_clean_run(
        job, tmp_path, seed, monkeypatch):
    """npy rows of big batches are written by pool threads at their offsets: a kill may land
    with several batches' writes pending; no shard with a hole is ever journaled."""
    # every batch's rows written by the row pool, as big ones are: in the killed run (start()
    # passes this environment on) and in the resume
    monkeypatch.setenv("GRAPHRUN_ROW_POOL_BYTES", "1")
    rng = random.Random(seed)
    out = tmp_path / "out"
    kill_9_after(start(job.spec, out, overlap=True), out, rng.randint(1, 8),
                 rng.uniform(0, 0.03))
    check_committed_files_intact(out)
    result = cli("run", job.spec, "--out", out, "--resume", "-q")
    assert result.exit_code == 0, result.output
    check_equals_clean(out, job)


def test_a_bad_graphrun_overlap_value_is_refused_before_any_work(job, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHRUN_OVERLAP", "sometimes")
    result = cli("run", job.spec, "--out", tmp_path / "out", "-q")
    assert result.exit_code == 2
    assert "GRAPHRUN_OVERLAP='sometimes' is not one of on, off, auto" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_with_a_manifest_and_resume_completes(job, tmp_path, signum, overlap):
    out = tmp_path / "out"
    proc = start(job.spec, out, overlap=overlap)
    wait_until(proc, lambda: committed(out) >= 3)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, stderr
    assert f"interrupted by {signal.Signals(signum).name}" in stderr
    assert "--resume" in stderr and "Traceback" not in stderr

    m = manifest(out)
    t = m["totals"]
    assert m["status"] == "interrupted" and m["error"] is None
    assert t["overlapped"] is overlap
    assert 3 * ROWS_PER_FILE <= t["records_out"] and t["records_in"] < N_RECORDS
    assert t["records_in"] == t["records_out"] + t["records_rejected"]
    assert m["rejects"]["count"] == t["records_rejected"] == len(
        (out / "rejects.jsonl").read_text().splitlines())
    point = read_journal(out)
    assert [f["path"] for f in m["files"]] == [f.path for f in point.files]
    assert point.rows == t["records_out"]
    check_committed_files_intact(out)

    result = cli("run", job.spec, "--out", out, "--resume", "-q")
    assert result.exit_code == 0, result.output
    check_equals_clean(out, job)


@pytest.mark.parametrize("overlap", ["off", "on"], ids=["serial", "overlapped"])
def test_second_sigint_stops_at_once_still_resumable(job, tmp_path, monkeypatch, overlap):
    monkeypatch.setenv("GRAPHRUN_OVERLAP", overlap)
    out = tmp_path / "out"
    (job.folder / "send-two-sigints").touch()
    try:
        result = cli("run", job.spec, "--out", out, "-q")
    except KeyboardInterrupt:
        pytest.fail("a second SIGINT escaped graphrun.run as a bare KeyboardInterrupt")
    finally:
        (job.folder / "send-two-sigints").unlink(missing_ok=True)
    assert result.exit_code == 130, result.output
    assert "interrupted by SIGINT" in result.output and "Traceback" not in result.output
    m = manifest(out)
    assert m["status"] == "interrupted"
    assert m["totals"]["records_in"] < N_RECORDS
    check_committed_files_intact(out)
    result = cli("run", job.spec, "--out", out, "--resume", "-q")
    assert result.exit_code == 0, result.output
    check_equals_clean(out, job)


def test_a_crash_in_the_model_is_recorded_and_the_run_resumes(job, tmp_path):
    out = tmp_path / "out"
    (job.folder / "crash").touch()
    try:
        with pytest.raises(ModelError, match="RuntimeError: the model broke at call 40") as err:
            graphrun.run(graphrun.load_spec(job.spec), out=out)
    finally:
        (job.folder / "crash").unlink()
    m = manifest(out)
    assert m["status"] == "failed"
    assert m["error"] == str(err.value) and "in bucket batch=16" in m["error"]
    check_committed_files_intact(out)
    result = cli("run", job.spec, "--out", out, "--resume", "-q")
    assert result.exit_code == 0, result.output
    check_equals_clean(out, job, same_shards=False)


def test_a_resumed_run_batches_records_as_a_clean_run(tmp_path):
    tagged = spec_dict(target="model.py:build_tagged")
    tagged["outputs"]["bucket"] = {"shape": ["batch"]}
    tagged["buckets"]["batch"] = [1, 2, 4, 8, 16]  # clean: last batch 10 -> 16; resumed: 8 -> 8
    spec = graphrun.load_spec(make_job(tmp_path, n=400, spec=tagged))
    graphrun.run(spec, out=tmp_path / "clean")
    graphrun.run(spec, out=tmp_path / "out")
    # As if killed -9 right after the first shard's commit (50 rows: mid-batch); the later
    # shards are on disk but not journaled, as after a kill between a rename and its journal line.
    journal = tmp_path / "out" / "journal.jsonl"
    journal.write_text(journal.read_text().splitlines(keepends=True)[0])
    assert graphrun.run(spec, out=tmp_path / "out", resume=True).resumed_from == 52  # 7, 13 bad

    def buckets(out):
        ids = [i for f in sorted(out.glob("part-*.ids.npy")) for i in np.load(f).tolist()]
        sizes = np.concatenate([np.load(f) for f in sorted(out.glob("part-*.bucket.npy"))])
        return dict(zip(ids, sizes.tolist()))

    assert buckets(tmp_path / "out") == buckets(tmp_path / "clean")

    # latencies.jsonl: the batches re-read after the resume point are not listed twice
    def batches(out):
        lines = [json.loads(x) for x in (out / "latencies.jsonl").read_text().splitlines()]
        return [(x["batch"], x["first"], x["bucket"], x["records"]) for x in lines]

    assert batches(tmp_path / "out") == batches(tmp_path / "clean")


def test_resume_of_a_completed_run_changes_nothing(job, tmp_path):
    out = tmp_path / "out"
    spec = graphrun.load_spec(job.spec)
    graphrun.run(spec, out=out, stop=500)
    before = {p.name: p.read_bytes() for p in out.glob("part-*")}
    rejects = (out / "rejects.jsonl").read_bytes()
    m = graphrun.run(spec, out=out, stop=500, resume=True)
    assert {p.name: p.read_bytes() for p in out.glob("part-*")} == before
    assert (out / "rejects.jsonl").read_bytes() == rejects
    assert m.status == "completed" and m.totals.records_in == 500
    assert m.totals.records_out + m.totals.records_rejected == 500


def test_a_signal_after_the_last_record_says_the_run_completed(tmp_path, monkeypatch):
    """A SIGTERM during the final commit (the run's last step, signals held) said "run again
    with --resume to continue", while the manifest said completed and --resume had nothing
    to do."""
    from graphrun.job.state import RunResources

    spec = make_job(tmp_path, n=40)
    hash_model = RunResources.record_model_hash

    def signalled(self):  # the signal comes while the run completes
        os.kill(os.getpid(), signal.SIGTERM)
        return hash_model(self)

    monkeypatch.setattr(RunResources, "record_model_hash", signalled)
    result = cli("run", spec, "-q")
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert ("interrupted by SIGTERM: the run had completed, every record written "
            "(manifest.json says so); nothing is left to resume") in result.output
    assert manifest(tmp_path / "out")["status"] == "completed"
    monkeypatch.undo()
    again = cli("run", spec, "--resume", "-q")
    assert again.exit_code == 0 and "already complete" in again.output


# ---- what a folder may be used for ---------------------------------------------------------------

@pytest.fixture
def small(tmp_path):
    """A 40-record job, already run into tmp_path/out."""
    spec = make_job(tmp_path, n=40)
    result = cli("run", spec, "-q")
    assert result.exit_code == 0, result.output
    return spec


@pytest.mark.parametrize("manifest", ["written", "never written (kill -9)"])
def test_resume_with_a_changed_spec_is_refused_naming_it(small, tmp_path, manifest):
    if manifest != "written":  # run.json's copy of the spec names the keys
        (tmp_path / "out" / "manifest.json").unlink()
    result = cli("run", small, "--resume", "--set", "capture.warmup_iters=2")
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "cannot resume" in text and "capture.warmup_iters was 1, now 2" in text
    assert "input_sha256" not in result.output and "--overwrite" in result.output


def test_resume_with_a_changed_input_is_refused_naming_it(small, tmp_path):
    with open(tmp_path / "data.jsonl", "a") as f:
        f.write('{"id": 40, "x": [1, 2, 3, 4]}\n')
    result = cli("run", small, "--resume")
    assert result.exit_code == 2
    assert "cannot resume" in result.output and "input_sha256 changed" in result.output
    assert "spec_sha256" not in result.output
    text = "".join(result.output.split())  # rich wraps a long path anywhere
    assert "".join(f"the input file {tmp_path / 'data.jsonl'} is not the file".split()) in text


def test_existing_folder_needs_resume_or_overwrite_and_overwrite_replaces(small, tmp_path):
    out = tmp_path / "out"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = cli("run", small, "-q")
    assert result.exit_code == 2
    assert "--resume" in result.output and "--overwrite" in result.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched

    write_data(tmp_path / "data.jsonl", 50, seed=7)
    result = cli("run", small, "-q", "--overwrite")
    assert result.exit_code == 0, result.output
    ids, _ = outputs(out)
    m = manifest(out)
    assert m["totals"]["records_in"] == 50 and m["resumed_from"] is None
    assert ids == good_ids(50)

    assert cli("run", small, "--resume", "--overwrite").exit_code == 2


def test_a_folder_holding_other_files_is_never_overwritten(small, tmp_path):
    out = tmp_path / "out"
    (out / "notes.txt").write_text("mine")
    result = cli("run", small, "-q", "--overwrite")
    assert result.exit_code == 2 and "notes.txt" in result.output
    assert (out / "notes.txt").read_text() == "mine" and list(out.glob("part-*"))


def test_rerun_after_a_setup_failure_reuses_the_folder(tmp_path):
    """Nothing was committed, so there is nothing to resume or protect: a plain rerun (the
    spec fixed) must not be sent to --resume (refused: the spec changed) or --overwrite."""
    broken = spec_dict()
    broken["model"]["args"]["no_such_arg"] = 1
    spec = make_job(tmp_path, n=40, spec=broken)
    result = cli("run", spec, "-q")
    assert result.exit_code == 2 and "no_such_arg" in result.output
    out = tmp_path / "out"
    assert manifest(out)["status"] == "failed"

    spec.write_text(yaml.safe_dump(spec_dict(), sort_keys=False))
    result = cli("run", spec, "-q")
    assert result.exit_code == 0, result.output
    m = manifest(out)
    assert m["status"] == "completed" and m["totals"]["records_in"] == 40
    assert json.loads((out / "run.json").read_text())["spec_sha256"] == m["spec_sha256"]


def test_a_folder_without_a_manifest_or_commits_is_kept_but_resumable(tmp_path):
    # What a run killed -9 during setup leaves, and what a run still in setup looks like:
    # with no manifest the two cannot be told apart, so a plain run must not take the folder.
    spec = make_job(tmp_path, n=40)
    out = tmp_path / "out"
    graphrun.run(graphrun.load_spec(spec), out=out)
    for p in out.iterdir():
        if p.name != "run.json":
            p.unlink()
    (out / ".part-00000.ids.npy.tmp").write_bytes(b"\x93NUMPY")
    (out / "rejects.jsonl").write_text('{"index": 7, "id": 7, "where": "", "reason": ""}\n')
    result = cli("run", spec, "-q")
    assert result.exit_code == 2 and "--resume" in result.output
    result = cli("run", spec, "-q", "--resume")  # nothing committed: starts over
    assert result.exit_code == 0, result.output
    m = manifest(out)
    assert m["totals"]["records_rejected"] == 40 - len(good_ids(40)) == 2
    assert m["resumed_from"] is None and not list(out.glob(".*.tmp"))


def test_a_completed_run_without_shards_is_still_protected(tmp_path):
    # Every record rejected: no shard, so no journal; the finished rejects must not be replaced.
    spec = make_job(tmp_path, n=0)
    (tmp_path / "data.jsonl").write_text('{"id": 0, "x": [1]}\n{"id": 1, "x": []}\n')
    assert cli("run", spec, "-q").exit_code == 1  # completed, but nothing came out
    out = tmp_path / "out"
    assert manifest(out)["status"] == "completed" and not (out / "journal.jsonl").exists()
    result = cli("run", spec, "-q")
    assert result.exit_code == 2 and "--overwrite" in result.output
    assert len((out / "rejects.jsonl").read_text().splitlines()) == 2


def test_a_failed_run_with_commits_is_not_reused(tmp_path):
    spec = make_job(tmp_path, n=40)
    error = ["--set", "data.on_bad_record=error", "--set", "data.batch_size=4",
             "--set", "output.rows_per_file=2"]
    result = cli("run", spec, "-q", *error)
    assert result.exit_code == 2 and "data.jsonl:8" in result.output  # record 7 holds a NaN
    out = tmp_path / "out"
    assert committed(out) >= 1
    result = cli("run", spec, "-q", *error)
    assert result.exit_code == 2 and "--resume" in result.output and "--overwrite" in result.output


def test_a_copied_run_folder_resumes_where_it_now_is(tmp_path):
    import shutil

    spec = graphrun.load_spec(make_job(tmp_path, n=400, spec=spec_dict()))
    graphrun.run(spec, out=tmp_path / "out")
    journal = tmp_path / "out" / "journal.jsonl"
    journal.write_text(journal.read_text().splitlines(keepends=True)[0])  # as if killed -9
    shutil.copytree(tmp_path / "out", tmp_path / "copy")
    moved = graphrun.load_spec(make_job(tmp_path, n=400, spec=spec_dict()),
                               [f"output.dir={tmp_path / 'copy'}"])
    m = graphrun.run(moved, resume=True)
    assert m.status == "completed" and m.resumed_from > 0
    assert m.totals.records_in == m.totals.records_out + m.totals.records_rejected == 400
    # a key that changes what is computed still refuses it, and names the key
    other = graphrun.load_spec(make_job(tmp_path, n=400, spec=spec_dict()),
                               ["data.batch_size=4"])
    journal = tmp_path / "copy" / "journal.jsonl"
    journal.write_text(journal.read_text().splitlines(keepends=True)[0])
    with pytest.raises(graphrun.OutputError, match="data.batch_size was") as err:
        graphrun.run(other, out=tmp_path / "copy", resume=True)
    assert "output.dir" not in str(err.value)  # the key that moved is no change to repeat
