"""Records are committed by time as well as by size (output.commit_interval_s): a job stopped
long before its first shard fills keeps what it wrote (a signal: all of it; kill -9: all but
the last interval's), and --resume completes it to the same bytes as a run never stopped.
The test stops a real `graphrun run` itself, once the journal holds an open line."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import graphrun
from graphrun.write.journal import read_journal
from tests.children import child_env
from tests.test_generate_job import write_spec as write_generation_spec

pytestmark = pytest.mark.slow

# A scorer slow enough that the stream is still going when the test stops it: it sleeps while
# a file named slow lies beside it, so the runs the test does not stop go at full speed.
MODEL = '''
import time
from pathlib import Path

import torch

from graphrun.models.builtin.mlp import build_mlp


class Slow(torch.nn.Module):
    def __init__(self, **args):
        super().__init__()
        self.mlp = build_mlp(**args)

    def forward(self, x):
        if (Path(__file__).parent / "slow").exists():
            time.sleep(0.05)
        return self.mlp(x)


def build(**args):
    return Slow(**args)
'''


def forward_job(folder: Path, fmt: str, **output) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(MODEL)
    with open(folder / "data.jsonl", "w") as f:
        for i in range(480):
            x = [((i * 7 + k) % 13) / 5 - 1 for k in range(4)]
            f.write(json.dumps({"id": i, "x": x if i % 50 != 3 else x[:3]}) + "\n")
    spec = {"version": 1, "name": "open-commits", "device": "cpu",
            "model": {"target": "model.py:build",
                      "args": {"in_features": 4, "hidden": 8, "layers": 2, "out_features": 3}},
            "inputs": {"x": {"shape": ["batch", 4]}},
            "outputs": {"scores": {"shape": ["batch", 3]}},
            "buckets": {"batch": [4, 16]},
            "data": {"path": "data.jsonl", "id_field": "id", "batch_size": 16,
                     "on_bad_record": "skip"},
            # one shard for the whole job: nothing would commit before its end by size
            "output": {"dir": "out", "format": fmt, "rows_per_file": 100000,
                       "commit_interval_s": 0.2, **output}}
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def generation_job(folder: Path) -> Path:
    """The shipped tiny Llama over 24 prompts, 2 a batch; its shard (rows_per_file left to
    the default) would hold 32,768 completions."""
    folder.mkdir(parents=True, exist_ok=True)
    return write_generation_spec(folder, n=24, data__group_by_length=None, data__batch_size=2,
                                 generate={"max_new_tokens": 16,
                                           "sampling": {"method": "greedy"}},
                                 output={"dir": str(folder / "out"), "format": "jsonl",
                                         "commit_interval_s": 0.05})


def clean_run(folder: Path, spec: Path) -> SimpleNamespace:
    out = folder / "clean"
    manifest = graphrun.run(graphrun.load_spec(spec), out=out)
    assert manifest.status == "completed" and len(list(out.glob("part-*"))) >= 1
    return SimpleNamespace(spec=spec, clean=out, manifest=manifest)


@pytest.fixture(scope="module")
def forward(tmp_path_factory):
    made = {}

    def job(fmt: str, **output) -> SimpleNamespace:
        key = (fmt, *sorted(output.items()))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"forward-{fmt}")
            made[key] = clean_run(folder, forward_job(folder, fmt, **output))
        return made[key]
    return job


@pytest.fixture(scope="module")
def generation(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation")
    return clean_run(folder, generation_job(folder))


def stop_after_an_open_commit(spec: Path, out: Path, signum: int) -> subprocess.Popen:
    """`graphrun run` in a child process, sent `signum` once a batch is committed while its
    shard is still open (an open line in the journal)."""
    with slow(spec):
        return _stop_after_an_open_commit(spec, out, signum)


@contextmanager
def slow(spec: Path):
    """The forward job's scorer sleeps a batch while this lasts (MODEL)."""
    mark = spec.parent / "slow"
    mark.touch()
    try:
        yield
    finally:
        mark.unlink()


def _stop_after_an_open_commit(spec: Path, out: Path, signum: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "graphrun", "run", str(spec), "--out",
                             str(out), "-q"], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    journal = out / "journal.jsonl"
    while not (journal.exists() and b'"open": true' in journal.read_bytes()):
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before it committed an open "
                        f"shard:\n{proc.stderr.read()}")
        assert time.monotonic() < deadline, "no open commit"
        time.sleep(0.005)
    proc.send_signal(signum)
    proc.communicate(timeout=120)
    return proc


def resume_and_compare(job: SimpleNamespace, out: Path, *, cli: bool = False) -> None:
    """--resume, in this process (cli: `graphrun run --resume` in a child), then the shards
    byte for byte against the run never stopped."""
    if cli:
        result = subprocess.run([sys.executable, "-m", "graphrun", "run", str(job.spec),
                                 "--out", str(out), "--resume", "-q"], env=child_env(),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    else:
        assert graphrun.run(graphrun.load_spec(job.spec), out=out,
                            resume=True).status == "completed"
    names = sorted(p.name for p in job.clean.glob("part-*"))
    assert sorted(p.name for p in out.glob("part-*")) == names
    for name in names:  # byte for byte: the shard the stop left open was written on
        assert (out / name).read_bytes() == (job.clean / name).read_bytes(), name
    assert not list(out.glob(".*.tmp"))
    if (job.clean / "rejects.jsonl").exists():
        assert (out / "rejects.jsonl").read_bytes() == (job.clean / "rejects.jsonl").read_bytes()
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "completed"
    assert m["totals"]["records_out"] == job.manifest.totals.records_out


def check_stopped(out: Path, proc: subprocess.Popen, signum: int) -> None:
    point = read_journal(out)
    assert point is not None and point.rows > 0 and point.files == []  # no shard filled
    if signum == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        return
    assert proc.returncode == 128 + signum, proc.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "interrupted"
    # a signal loses nothing written: every record read is committed, or read again
    assert m["totals"]["records_out"] == point.rows > 0
    assert m["totals"]["records_in"] == point.rows + point.rejects


@pytest.mark.parametrize("signum, fmt", [(signal.SIGTERM, "npy"), (signal.SIGKILL, "npy"),
                                         (signal.SIGKILL, "parquet"),
                                         (signal.SIGINT, "jsonl")],
                         ids=["SIGTERM-npy", "SIGKILL-npy", "SIGKILL-parquet", "SIGINT-jsonl"])
def test_a_forward_job_stopped_before_its_shard_fills_keeps_its_records(
        forward, tmp_path, signum, fmt):
    job = forward(fmt)
    out = tmp_path / "out"
    proc = stop_after_an_open_commit(job.spec, out, signum)
    check_stopped(out, proc, signum)
    resume_and_compare(job, out)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_generation_job_stopped_after_a_batch_keeps_its_completions(
        generation, tmp_path, signum):
    out = tmp_path / "out"
    proc = stop_after_an_open_commit(generation.spec, out, signum)
    check_stopped(out, proc, signum)
    resume_and_compare(generation, out, cli=signum == signal.SIGTERM)


@pytest.mark.parametrize("fmt, seed", [("npy", 1), ("parquet", 2), ("jsonl", 3)])
def test_kill_9_at_random_points_among_open_and_whole_commits_then_resume_is_the_same(
        forward, tmp_path, fmt, seed):
    """Commits every batch (open lines) and every 100 rows (whole shards): a kill lands
    between any two steps of either, twice (the resume too)."""
    job = forward(fmt, rows_per_file=100, commit_interval_s=0.005)
    rng = random.Random(seed)
    out = tmp_path / "out"
    with slow(job.spec):
        for attempt in range(2):
            again = ["--resume"] if attempt else []
            proc = subprocess.Popen([sys.executable, "-m", "graphrun", "run", str(job.spec),
                                     "--out", str(out), "-q", *again], env=child_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            lines = committed_lines(out) + rng.randint(1, 12)
            deadline = time.monotonic() + 120
            while committed_lines(out) < lines and proc.poll() is None:
                assert time.monotonic() < deadline, "no commit"
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.02))
            proc.kill()
            proc.communicate()
    resume_and_compare(job, out)


def committed_lines(out: Path) -> int:
    try:
        return (out / "journal.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def test_kill_9_while_prompts_share_their_opening_then_resume_is_the_same(tmp_path):
    """Prompts opening with one long system text (several full KV blocks, shared through the
    prefix cache): a kill -9 after an open commit, then --resume, writes what a run never
    killed writes; the resumed process starts with an empty cache."""
    folder = tmp_path / "shared"
    folder.mkdir()
    spec = write_generation_spec(folder, n=24, data__group_by_length=None, data__batch_size=2,
                                 generate={"max_new_tokens": 16,
                                           "sampling": {"method": "greedy"}},
                                 output={"dir": str(folder / "out"), "format": "jsonl",
                                         "commit_interval_s": 0.05})
    system = " ".join(["The archive keeps every letter the river town ever sent."] * 8)
    data = folder / "prompts.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    data.write_text("".join(json.dumps({**r, "prompt": f"{system} {r['prompt']}"}) + "\n"
                            for r in rows))
    job = clean_run(folder, spec)
    assert job.manifest.generation.prompt_tokens_reused > 0  # the opening was shared
    out = tmp_path / "out"
    proc = stop_after_an_open_commit(spec, out, signal.SIGKILL)
    check_stopped(out, proc, signal.SIGKILL)
    resume_and_compare(job, out)
