"""One job over several worker processes on one host (issue 19): `graphrun run --gpus N` with
device: cpu (N CPU workers, the launcher's code path), and the same workers started as
torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Outputs must
equal one process's record for record; a worker killed with SIGKILL fails the job naming it,
and --resume completes it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main
from graphrun.base.errors import GraphrunError
from graphrun.write.journal import sha256_file
from graphrun.scale.local.workers import worker_count
from graphrun.scale.local.world import split

# end to end: processes, real models, whole runs (`pytest -m "not slow"` leaves them out)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
N = 3200  # shares of 1600: whole shards (40) and batches (16) within 1/20
ROWS_PER_FILE = 40

# The builtin mlp; while a file "slow" sits beside it, each batch takes 30 ms (a worker is
# then still streaming when the test kills it). The spec stays the same, so --resume works.
MODEL = '''\
import time
from pathlib import Path

import torch

from graphrun.models.builtin.mlp import build_mlp

SLOW = Path(__file__).with_name("slow")


class Scorer(torch.nn.Module):
    def __init__(self, **args):
        super().__init__()
        self.mlp = build_mlp(**args)
        self.slow = SLOW.exists()

    def forward(self, x):
        if self.slow:
            time.sleep(0.03)
        return self.mlp(x)


def build(**args):
    return Scorer(**args)
'''


def spec_dict(data: str, fmt: str) -> dict:
    return {
        "version": 1, "name": "scale", "device": "cpu",
        "model": {"target": "model.py:build",
                  "args": {"in_features": 4, "hidden": 8, "layers": 2, "out_features": 3}},
        "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32", "finite": True}},
        "outputs": {"scores": {"shape": ["batch", 3]}},
        "buckets": {"batch": [1, 4, 16]},
        "capture": {"warmup_iters": 1},
        "data": {"path": data, "id_field": "id", "batch_size": 16, "on_bad_record": "skip"},
        "output": {"dir": "out", "format": fmt, "rows_per_file": ROWS_PER_FILE},
    }


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Two specs (JSONL in, npy out; npz in, JSONL out) and one process's run of each."""
    folder = tmp_path_factory.mktemp("scale")
    (folder / "model.py").write_text(MODEL)
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, (N, 4)).round(4).astype(np.float32)
    with open(folder / "data.jsonl", "w") as f:
        for i in range(N):
            row = x[i].tolist()[: 3 if i % 97 == 13 else 4]  # bad: a short x
            f.write(json.dumps({"id": f"r{i}", "x": row}) + "\n")
    x[::131, 0] = np.nan  # bad: NaN with finite: true
    np.savez(folder / "data.npz", x=x, id=np.arange(N, dtype=np.int64) * 10)
    specs = {}
    for name, data, fmt in (("jsonl", "data.jsonl", "npy"), ("npz", "data.npz", "jsonl")):
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec_dict(data, fmt), sort_keys=False))
        graphrun.run(graphrun.load_spec(path), out=folder / f"one-{name}")
        specs[name] = path
    return SimpleNamespace(folder=folder, specs=specs)


def cli(*args, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "graphrun", "run", *map(str, args)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)


def finish(proc: subprocess.Popen, rc: int = 0) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == rc, out + err
    return err


def run_here(*args, rc: int = 0) -> str:
    """`graphrun run ARGS` as the command line runs it, but in this process (CliRunner: no
    interpreter start and torch import of its own for the --gpus parent; its workers are
    processes all the same); what it printed. For a test's later runs, whose parent's being
    a process is not what the test is about: each test's first run stays a process."""
    result = CliRunner().invoke(main, ["run", *map(str, args)])
    assert result.exit_code == rc, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        result.exception  # an exit status, not a bug's exception counted as status 1
    return result.output


def records(out: Path) -> tuple[list, np.ndarray]:
    """All shards in name order: ids and scores [n, 3]."""
    if any(out.glob("part-*.jsonl")):
        lines = [json.loads(ln) for f in sorted(out.glob("part-*.jsonl"))
                 for ln in f.read_text().splitlines()]
        return [r["id"] for r in lines], np.array([r["scores"] for r in lines])
    ids = [i for f in sorted(out.glob("part-*.ids.npy")) for i in np.load(f).tolist()]
    return ids, np.concatenate([np.load(f) for f in sorted(out.glob("part-*.scores.npy"))])


def equal_within_rounding(got: np.ndarray, want: np.ndarray) -> None:
    """A job's values against one process's. A share starts at a whole batch, but a batch is
    batch_size good records, so after a share's rejects its last batches differ from one
    process's and run in other buckets, whose kernels may sum in another order: each score is
    a sum over at most 8 products per layer (hidden: 8), so a reordered float32 sum differs by
    a few ulps of the magnitudes summed; 16 eps (relative, and absolute for scores near 0,
    whose terms are of order 1) bounds that with room, and catches any real difference."""
    eps = np.finfo(np.float32).eps  # the spec's outputs are float32 (read back from JSONL too)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=16 * eps, atol=16 * eps)


def check_equals_one_process(out: Path, one: Path) -> dict:
    ids, scores = records(out)
    want_ids, want_scores = records(one)
    assert ids == want_ids and len(set(ids)) == len(ids)
    equal_within_rounding(scores, want_scores)
    assert (out / "rejects.jsonl").read_bytes() == (one / "rejects.jsonl").read_bytes()
    m = json.loads((out / "manifest.json").read_text())
    jsonschema.validate(m, json.loads((ROOT / "schemas/manifest.schema.json").read_text()))
    t, w = m["totals"], m["workers"]
    assert m["status"] == "completed" and t["records_in"] == N
    assert t["records_out"] + t["records_rejected"] == N == sum(x["records_in"] for x in w)
    assert t["records_out"] == len(ids) == sum(x["records_out"] for x in w)
    assert sum(f["rows"] for f in m["files"] if f["path"].endswith((".ids.npy", ".jsonl"))) \
        == len(ids)
    # the spec, its digest, the input and the rejects said as one process says them
    alone = json.loads((one / "manifest.json").read_text())
    same = ("name", "spec_sha256", "rejects")
    assert {k: m[k] for k in same} == {k: alone[k] for k in same}
    assert {k: v for k, v in m["input"].items() if k != "slice"} == alone["input"]
    ran = sum(b["records"] for b in m["buckets"])  # a resumed worker runs one batch again
    assert 0 <= ran - (t["records_out"] - t["earlier_records_out"]) <= 16 * len(w)
    return m


# Loaded at the start of every graphrun process the tests start with it on PYTHONPATH (not
# the hashing children, which run isolated): each InputHash made, for the input or for one of
# the model's files (folder.FilesHash makes one per file), is a line "pid path". A patch: the
# workers are processes of their own, which no caller here can hand anything to.
COUNT_HASHES = """\
import os

from graphrun.write import journal

_init = journal.InputHash.__init__


def _counted(self, path, *args, **kwargs):
    with open(os.environ["HASH_MARKER"], "a") as f:
        f.write(f"{os.getpid()} {path}\\n")
    _init(self, path, *args, **kwargs)


journal.InputHash.__init__ = _counted
"""


def counting_hashes(tmp_path, env=None) -> tuple[dict, Path]:
    """An environment whose graphrun processes log every InputHash, and the log's path."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(COUNT_HASHES)
    env = dict(env or os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    env["HASH_MARKER"] = str(tmp_path / "hashes.log")
    return env, tmp_path / "hashes.log"


def hashed_by(log: Path, data: Path) -> list[int]:
    """The pids that hashed the file `data`."""
    lines = [ln.split(" ", 1) for ln in log.read_text().splitlines()]
    return [int(pid) for pid, path in lines if Path(path) == data]


def check_hashed_once(out: Path, data: Path, model: dict[str, Path], one: Path, log: Path,
                      pid: int) -> None:
    """The input and each of the model's files (by role) hashed once for the job (by `pid`),
    and every run.json and manifest of the job says the digests one process's run (in `one`)
    says."""
    single = json.loads((one / "run.json").read_text())
    for path in [data, *model.values()]:
        assert hashed_by(log, path) == [pid], (path, hashed_by(log, path))
    want = single["input_sha256"]
    job = json.loads((out / "manifest.json").read_text())
    assert job["input"]["sha256"] == want
    for k in range(len(job["workers"])):
        rank = out / f"workers/rank-{k}"
        fingerprint = json.loads((rank / "run.json").read_text())
        assert fingerprint["input_sha256"] == want
        assert fingerprint["model_sha256"] == single["model_sha256"] == {
            role: sha256_file(path) for role, path in model.items()}
        m = json.loads((rank / "manifest.json").read_text())
        assert m["input"]["sha256"] == want
        phases = {p["name"]: p["s"] for p in m["phases"]["top"]}
        assert phases["input hash wait"] >= m["totals"]["input_hash_s"]  # the shared digest's
        assert sum(phases.values()) == pytest.approx(m["totals"]["process_wall_s"], rel=0.02)


def test_gpus_2_on_the_cpu_equals_one_process(job, tmp_path):
    out = tmp_path / "job"
    env, log = counting_hashes(tmp_path)
    proc = cli(job.specs["jsonl"], "--gpus", "2", "--out", out, "-q", env=env)
    finish(proc)
    check_hashed_once(out, job.folder / "data.jsonl", {"target": job.folder / "model.py"},
                      job.folder / "one-jsonl", log, proc.pid)
    m = check_equals_one_process(out, job.folder / "one-jsonl")
    assert [(w["rank"], w["device"], w["status"]) for w in m["workers"]] == [
        (0, "cpu", "completed"), (1, "cpu", "completed")]
    assert m["workers"][0]["slice"] == [0, 1600] and m["workers"][1]["slice"] == [1600, N]
    assert m["workers"][1]["shards"] == [40, 80]  # from its share's first shard: 1600 / 40
    # each worker's last shard is partial (its rejects), so shard 40 starts worker 1's rows
    first = np.load(out / "part-00040.ids.npy")[0]
    assert first == "r1600" and len(np.load(out / "part-00039.ids.npy")) < ROWS_PER_FILE
    assert (out / "workers/rank-1/journal.jsonl").exists()
    # the job as finished: --resume changes nothing (its manifest's timings included) and
    # says so, a one-process run is refused
    before = (out / "manifest.json").read_bytes()
    said = run_here(job.specs["jsonl"], "--gpus", "2", "--out", out, "--resume")
    assert said.startswith("already complete: ") and "nothing to resume" in said, said
    assert (out / "manifest.json").read_bytes() == before
    check_equals_one_process(out, job.folder / "one-jsonl")
    err = run_here(job.specs["jsonl"], "--out", out, "-q", "--resume", rc=2)
    assert "holds a different run" in err or "one process" in err, err


def own_copy(job, tmp_path) -> Path:
    """The JSONL spec, its model and its input in tmp_path: a test may change the input."""
    for name in ("model.py", "data.jsonl", "jsonl.yaml"):
        (tmp_path / name).write_bytes((job.folder / name).read_bytes())
    return tmp_path / "jsonl.yaml"


def test_resume_of_a_job_whose_input_changed_is_refused(job, tmp_path):
    spec = own_copy(job, tmp_path)
    out = tmp_path / "job"
    run_here(spec, "--gpus", "2", "--out", out, "-q", "--stop", "320")
    with open(tmp_path / "data.jsonl", "a") as f:  # records past the slice: still another input
        f.write(json.dumps({"id": "new", "x": [1, 2, 3, 4]}) + "\n")
    manifest = (out / "manifest.json").read_bytes()
    err = finish(cli(spec, "--gpus", "2", "--out", out, "-q", "--stop", "320", "--resume"),
                 rc=2)  # as one process's refusal
    # either worker may be the first to report it
    assert re.search(r"worker rank [01] \(cpu\)", err) and "cannot resume" in err, err
    assert "input_sha256 changed" in err and "--overwrite" in err, err
    # no worker ran: the completed job's manifest is left as it was, not rewritten as failed
    assert "no worker ran: the job's folder is as it was" in err, err
    assert (out / "manifest.json").read_bytes() == manifest
    want = sha256_file(tmp_path / "data.jsonl")
    record = json.loads((out / "workers/input.sha256").read_text())
    assert record["input"]["sha256"] == {"input": want}


@pytest.mark.parametrize("manifest", ["written", "never written (kill -9)"])
def test_resume_of_a_job_whose_spec_changed_names_the_keys(job, tmp_path, manifest):
    spec = own_copy(job, tmp_path)
    out = tmp_path / "job"
    run_here(spec, "--gpus", "2", "--out", out, "-q", "--stop", "320")
    if manifest != "written":  # the job's run.json holds the spec it started with
        (out / "manifest.json").unlink()
    said = " ".join(run_here(spec, "--gpus", "2", "--out", out, "-q", "--stop", "320",
                             "--resume", "--set", "capture.warmup_iters=7", rc=2).split())
    assert "the spec changed since the job started (capture.warmup_iters was " in said, said
    assert ", now 7); to resume it, repeat the interrupted run's settings (--set " \
           "capture.warmup_iters=" in said, said


def test_weights_hashed_once_and_resume_after_they_changed_is_refused(job, tmp_path):
    """The builtin mlp given a weights file: the --gpus parent hashes it once for the job, and
    every worker's run.json says the digest one process's says; --resume after the weights
    changed is refused, naming the file, and goes on with --accept-model-change."""
    import torch

    from graphrun.models.builtin.mlp import build_mlp

    args = {"in_features": 4, "hidden": 8, "layers": 2, "out_features": 3}
    weights = tmp_path / "w.pt"
    torch.save(build_mlp(**args, seed=3).state_dict(), weights)
    (tmp_path / "data.jsonl").write_bytes((job.folder / "data.jsonl").read_bytes())
    spec = tmp_path / "weights.yaml"
    spec.write_text(yaml.safe_dump({**spec_dict("data.jsonl", "npy"), "model": {
        "builtin": "mlp", "args": args, "weights": "w.pt"}}, sort_keys=False))
    graphrun.run(graphrun.load_spec(spec), out=tmp_path / "one", stop=320)
    out = tmp_path / "job"
    env, log = counting_hashes(tmp_path)
    proc = cli(spec, "--gpus", "2", "--out", out, "-q", "--stop", "320", env=env)
    finish(proc)
    check_hashed_once(out, tmp_path / "data.jsonl", {"weights": weights}, tmp_path / "one",
                      log, proc.pid)
    torch.save(build_mlp(**args, seed=4).state_dict(), weights)
    err = run_here(spec, "--gpus", "2", "--out", out, "-q", "--stop", "320", "--resume", rc=2)
    # either worker may be the first to report it
    assert re.search(r"worker rank [01] \(cpu\)", err) and "cannot resume" in err, err
    assert f"weights file {weights} changed" in err and "--accept-model-change" in err, err
    assert "run the same command again with --resume" not in err, err
    run_here(spec, "--gpus", "2", "--out", out, "-q", "--stop", "320", "--resume",
             "--accept-model-change")
    record = json.loads((out / "workers/input.sha256").read_text())
    assert record["model"]["sha256"] == {"weights": sha256_file(weights)}


def test_a_failed_hash_in_the_parent_fails_the_job_clearly(job, tmp_path, monkeypatch):
    """The --gpus parent (this process) cannot hash the input: its workers end with its
    error instead of waiting, and the job fails naming it."""
    from graphrun.write import journal
    from graphrun.scale.local.workers import launch

    def failing_hash(self):
        self._error = OSError("[Errno 5] Input/output error")

    # a patch: the --gpus parent hashes inside launch(), with no caller
    monkeypatch.setattr(journal.InputHash, "_hash", failing_hash)
    spec = graphrun.load_spec(job.specs["jsonl"])
    t0 = time.monotonic()
    with pytest.raises(GraphrunError, match=r"worker rank \d \(cpu\) .*the --gpus "
                       r"parent \(pid \d+\) could not hash the input for the job's workers: "
                       r".*Input/output error"):
        launch(spec, job.specs["jsonl"], [], gpus="2", out=tmp_path / "job", resume=False,
               overwrite=False, accept_model_change=False, start=0, stop=320, show=False)
    assert time.monotonic() - t0 < 120
    m = json.loads((tmp_path / "job/manifest.json").read_text())
    assert m["status"] == "failed"


def test_torchrun_workers_equal_one_process(job, tmp_path):
    """As torchrun starts them: no parent; rank 0 prepares the folder and merges."""
    out = tmp_path / "job"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env, log = counting_hashes(tmp_path)
    procs = [cli(job.specs["npz"], "--out", out, "-q",
                 env=dict(env, RANK=str(k), LOCAL_RANK=str(k), WORLD_SIZE="2",
                          LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for k in range(2)]
    for p in procs:
        finish(p)
    check_hashed_once(out, job.folder / "data.npz", {"target": job.folder / "model.py"},
                      job.folder / "one-npz", log, procs[0].pid)  # rank 0's
    m = check_equals_one_process(out, job.folder / "one-npz")
    assert records(out)[0][:3] == [10, 20, 30]  # the npz's ids (record 0 has a NaN)
    assert len(m["workers"]) == 2


def start_slow(job, out: Path, *extra) -> subprocess.Popen:
    (job.folder / "slow").write_text("")
    return cli(job.specs["jsonl"], "--gpus", "2", "--out", out, "-q", *extra)


def wait_for_commits(proc, out: Path, rank: int, lines: int) -> None:
    journal = out / f"workers/rank-{rank}/journal.jsonl"
    deadline = time.monotonic() + 120
    while not (journal.exists() and journal.read_bytes().count(b"\n") >= lines):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the workers made no progress"
        time.sleep(0.02)


def worker_pid(parent: int, rank: int) -> int:
    for entry in Path("/proc").iterdir():
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"GRAPHRUN_JOB_PARENT={parent}".encode() in env and f"RANK={rank}".encode() in env:
            return int(entry.name)
    raise AssertionError(f"no worker of rank {rank}")


def test_kill_9_of_a_worker_fails_naming_it_and_resume_completes(job, tmp_path):
    out = tmp_path / "job"
    proc = start_slow(job, out)
    try:
        wait_for_commits(proc, out, 1, 2)
        os.kill(worker_pid(proc.pid, 1), signal.SIGKILL)
        err = finish(proc, rc=1)
    finally:
        (job.folder / "slow").unlink()
    assert "worker rank 1 (cpu) was killed by SIGKILL" in err and "--resume" in err, err
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "failed" and m["workers"][1]["status"] == "failed"
    assert m["workers"][1]["records_out"] >= 2 * ROWS_PER_FILE  # its commits, from its journal
    run_here(job.specs["jsonl"], "--gpus", "2", "--out", out, "-q", "--resume")
    m = check_equals_one_process(out, job.folder / "one-jsonl")
    assert m["totals"]["earlier_records_out"] > 0


def test_sigterm_to_the_parent_stops_every_worker_and_resume_completes(job, tmp_path):
    out = tmp_path / "job"
    proc = start_slow(job, out)
    try:
        wait_for_commits(proc, out, 0, 1)
        proc.send_signal(signal.SIGTERM)
        err = finish(proc, rc=128 + signal.SIGTERM)
    finally:
        (job.folder / "slow").unlink()
    assert "interrupted by SIGTERM" in err and "--resume" in err, err
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "interrupted"
    assert m["totals"]["records_out"] + m["totals"]["records_rejected"] < N
    err = run_here(job.specs["jsonl"], "--gpus", "3", "--out", out, "-q", "--resume", rc=2)
    assert "holds a job of 2 workers: resume it with --gpus 2" in err, err
    run_here(job.specs["jsonl"], "--gpus", "2", "--out", out, "-q", "--resume")
    check_equals_one_process(out, job.folder / "one-jsonl")


def test_overwrite_of_a_job_folder_keeps_a_users_file(job, tmp_path):
    """The nothing-lost rules hold for a job's folder: only graphrun's files are removed."""
    from graphrun.write.folder import split_entries

    out = tmp_path / "job"
    (out / "workers/rank-0").mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"spec_sha256": "x", "shards": ["ids.npy"],
                                              "workers": [{"slice": [0, 9], "shards": [0, 1]}]}))
    (out / "workers/rank-0/journal.jsonl").write_text("")
    (out / "part-00000.ids.npy").write_text("")  # its unfinished range: graphrun's
    (out / "part-00001.ids.npy").write_text("")  # beyond every range: not graphrun's
    (out / "workers/input.sha256").write_text("{}")  # the job's input hash: graphrun's
    own, foreign = split_entries(out)
    assert sorted(p.name for p in own) == ["part-00000.ids.npy", "run.json", "workers"]
    assert [p.name for p in foreign] == ["part-00001.ids.npy"]
    (out / "workers/rank-0/notes.txt").write_text("mine")
    assert "workers" in [p.name for p in split_entries(out)[1]]


def test_shares_cover_the_records_with_unique_shards_in_order():
    for start, stop, workers, rows, batch in [(0, 1200, 2, 40, 16), (7, 1007, 3, 100, 8),
                                              (0, 10, 4, 100000, 4), (0, 524288, 2, 65536, 128)]:
        cuts = split(start, stop, workers, rows, batch)
        assert cuts[0][0] == start and cuts[-1][1] == stop
        for (s, e, f, g), nxt in zip(cuts, cuts[1:] + [None]):
            assert s <= e and g - f >= -(-(e - s) // rows)  # room for every shard it may write
            if nxt:
                assert e == nxt[0] and g == nxt[2]
    assert split(0, 524288, 2, 65536, 128) == [(0, 262144, 0, 4), (262144, 524288, 4, 8)]


def test_gpus_without_cuda_is_a_clear_error_unless_the_device_is_cpu(job):
    spec = graphrun.load_spec(job.specs["jsonl"])
    assert worker_count("3", spec) == 3
    if __import__("torch").cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(GraphrunError, match="no CUDA device.*set device: cpu"):
        worker_count("2", spec.model_copy(update={"device": "auto"}))
    with pytest.raises(GraphrunError, match="--gpus all: this machine has no CUDA device"):
        worker_count("all", spec)
    with pytest.raises(GraphrunError, match="give a number of workers"):
        worker_count("two", spec)


def test_a_worker_knows_its_place_from_torchruns_variables():
    from graphrun.scale.local.world import World

    assert World.from_env({}) is None and World.from_env({"WORLD_SIZE": "1"}) is None
    w = World.from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1",
                        "LOCAL_WORLD_SIZE": "2"})
    assert (w.rank, w.size, w.local_rank, w.local_size, w.parent) == (3, 4, 1, 2, None)
    one = World.from_env({"WORLD_SIZE": "1", "RANK": "0", "GRAPHRUN_JOB_PARENT": "77"})
    assert (one.size, one.parent) == (1, 77)  # --gpus 1: still a job of one worker
    with pytest.raises(GraphrunError, match="RANK=5 / LOCAL_RANK=5 is outside WORLD_SIZE=2"):
        World.from_env({"WORLD_SIZE": "2", "RANK": "5"})
    with pytest.raises(GraphrunError, match="not a whole number"):
        World.from_env({"WORLD_SIZE": "2"})


@pytest.mark.parametrize("module, left", [("graphrun.scale.local.merge", "rejects.jsonl.tmp"),
                                          ("graphrun.manifest.keys", "manifest.json.tmp")])
def test_a_full_disk_as_the_job_is_merged_is_one_message_and_no_temp_file(
        job, tmp_path, monkeypatch, module, left):
    """The parent's merge of the workers' rejects, or of their manifests, meets a full disk
    (the workers wrote theirs): one message naming the disk, no temp file left."""
    import errno
    import importlib

    from graphrun.base.nofollow import open_file

    class Full:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def full_open(file, mode="r", **k):
        f = open_file(file, mode, **k)
        return Full(f) if str(file).endswith(left) else f

    # a patch: the CLI's --gpus parent merges, reached only through the command
    monkeypatch.setattr(importlib.import_module(module), "open_file", full_open)
    out = tmp_path / "job"
    printed = run_here(job.specs["jsonl"], "--gpus", "2", "--out", out, "-q", rc=2)
    assert "No space left on device" in printed and "--resume" in printed, printed
    assert "Traceback" not in printed
    assert not list(out.glob("*.tmp")), sorted(p.name for p in out.iterdir())


def test_resume_of_a_completed_job_names_a_stray_shard(job, tmp_path):
    out = tmp_path / "job"
    run_here(job.specs["jsonl"], "--gpus", "2", "--out", out, "-q")
    mark = json.loads((out / "run.json").read_text())
    past = max(w["shards"][1] for w in mark["workers"])
    stray = f"part-{past:05d}.ids.npy"  # a number no worker's share holds
    (out / stray).write_bytes((out / "part-00000.ids.npy").read_bytes())
    printed = run_here(job.specs["jsonl"], "--gpus", "2", "--out", out, "-q", "--resume",
                       rc=2)
    text = " ".join(printed.split())
    assert f"holds {stray}, named as the job's shards but numbered outside" in text, text
