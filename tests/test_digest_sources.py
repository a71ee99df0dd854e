"""The manifest says where each sha256 of a run came from (manifest.digests): read on the
first run, from the kept digests on the next run of the same files, read again once a file
changed, and a digest taken from the cache costs no read of the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

import graphrun
from graphrun.base.tuning import Tuning
from graphrun.write import journal

MODEL = '''import torch


def build(max_batch):
    return torch.nn.Linear(4, 2)
'''


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A spec whose input, weights and target source are all kept (run() keeps every file's
    digest), the cache in the test's folder."""
    monkeypatch.setenv("GRAPHRUN_HASH_CACHE", str(tmp_path / "cache"))
    from safetensors.torch import save_file

    (tmp_path / "net.py").write_text(MODEL)
    torch.manual_seed(0)
    save_file(torch.nn.Linear(4, 2).state_dict(), str(tmp_path / "w.safetensors"))
    (tmp_path / "in.jsonl").write_text("".join(
        json.dumps({"x": [i, 1.0, 2.0, 3.0]}) + "\n" for i in range(10)))
    spec = {"version": 1, "name": "d", "device": "cpu",
            "model": {"target": "net.py:build", "weights": "w.safetensors",
                      "call": "positional"},
            "inputs": {"x": {"shape": ["batch", 4]}}, "outputs": {"y": {"shape": ["batch", 2]}},
            "buckets": {"batch": [4]}, "data": {"path": "in.jsonl", "batch_size": 4},
            "output": {"dir": "out"}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run(spec: Path) -> tuple[dict, dict, int]:
    """(manifest.digests, run.json, how many files a hashing child process read)."""
    reads = []
    real = journal.subprocess.Popen

    def spy(args, *more, **kwargs):
        if journal.InputHash.CHILD in args:
            reads.append(args[-1])
        return real(args, *more, **kwargs)

    journal.subprocess.Popen = spy
    try:
        manifest = graphrun.run(graphrun.load_spec(spec), overwrite=True,
                                tuning=Tuning.from_machine(hash_keep_bytes=1))
    finally:
        journal.subprocess.Popen = real
    run_json = json.loads((spec.parent / "out" / "run.json").read_text())
    return manifest.digests.model_dump(), run_json, len(reads)


def test_a_second_run_of_the_same_files_takes_their_digests_from_the_cache(job):
    every = {"input": "read", "model": {"weights": "read", "target": "read"}}
    first, run_json, reads = run(job)
    assert first == every and reads == 3
    second, again, reads = run(job)
    assert second == {"input": "cache", "model": {"weights": "cache", "target": "cache"}}
    assert reads == 0
    assert again["model_sha256"] == run_json["model_sha256"]
    assert again["input_sha256"] == run_json["input_sha256"]
    written = json.loads((job.parent / "out" / "manifest.json").read_text())
    assert written["digests"]["model"]["weights"] == "cache"


def test_a_changed_file_is_hashed_again(job):
    run(job)
    weights = job.parent / "w.safetensors"
    from safetensors.torch import save_file

    torch.manual_seed(1)  # other values, the same size
    save_file(torch.nn.Linear(4, 2).state_dict(), str(weights))
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    got, run_json, reads = run(job)
    assert got == {"input": "cache", "model": {"weights": "read", "target": "cache"}}
    assert reads == 1
    assert run_json["model_sha256"]["weights"] == journal.sha256_file(weights)
    with open(job.parent / "in.jsonl", "a") as f:  # a record more: another size
        f.write(json.dumps({"x": [9.0, 1.0, 2.0, 3.0]}) + "\n")
    got, run_json, reads = run(job)
    assert got["input"] == "read" and reads == 1
    assert run_json["input_sha256"] == journal.sha256_file(job.parent / "in.jsonl")


class FirstAsked:
    """The model's digests (folder.FilesHash), noting what the output folder held when the
    run first asked for them."""

    def __init__(self, out: Path, files: dict):
        from graphrun.write.folder import FilesHash

        self.out, self.inner, self.held = out, FilesHash(files), None

    def result(self):
        if self.held is None:
            self.held = sorted(p.name for p in self.out.iterdir())
        return self.inner.result()

    def stop(self):
        return self.inner.stop()

    @property
    def source(self):
        return self.inner.source


def test_the_stream_starts_before_the_models_hash_and_commits_after_it(job):
    from graphrun.job.spine import run as run_job
    from graphrun.job.state import RunHashes
    from graphrun.write.folder import model_files

    spec = graphrun.load_spec(job, overrides=["output.rows_per_file=4"])
    model = FirstAsked(spec.output.dir, model_files(spec.model, spec.base_dir))
    manifest = run_job(spec, hashes=RunHashes(journal.InputHash(spec.data.path), model))
    assert manifest.status == "completed" and manifest.totals.records_out == 10
    # first asked for at the first shard's hand-over: rows written, nothing journaled
    assert any(name.startswith(".part-00000") for name in model.held), model.held
    assert "journal.jsonl" not in model.held
    run_json = json.loads((spec.output.dir / "run.json").read_text())
    assert run_json["model_sha256"] == {
        "weights": journal.sha256_file(job.parent / "w.safetensors"),
        "target": journal.sha256_file(job.parent / "net.py")}
