"""Messages that sent the user in circles, and a record that raised instead of being rejected
(issue 28): a folder left with only .run.json.tmp simply starts; a JSONL integer longer than
Python reads is one rejected record; the input failing to read (EIO) is the input's error, not
the output folder's, and --resume completes the run."""

from __future__ import annotations

import errno
import json
import sys
from functools import partial

from click.testing import CliRunner

from graphrun.cli.main import main
from tests.test_faults_folder import check_equals_clean, make_job, manifest


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_folder_with_only_a_first_run_json_temp_simply_starts(tmp_path):
    # What a kill -9 while the first run.json is written leaves: nothing committed, nothing
    # of the user's; a plain run was sent to --resume, and --resume to --overwrite.
    spec = make_job(tmp_path, n=40)
    for extra in ([], ["--resume"]):
        out = tmp_path / f"out{len(extra)}"
        out.mkdir()
        (out / ".run.json.tmp").write_text('{"spec_sha')
        result = cli("run", spec, "-q", "--out", out, *extra)
        assert result.exit_code == 0, result.output
        assert manifest(out)["status"] == "completed" and not (out / ".run.json.tmp").exists()
        assert manifest(out)["totals"]["records_in"] == 40


def test_a_jsonl_integer_longer_than_python_reads_is_one_rejected_record(tmp_path):
    spec = make_job(tmp_path, n=40)
    lines = (tmp_path / "data.jsonl").read_text().splitlines()
    digits = "9" * (sys.get_int_max_str_digits() + 1)
    lines[3] = '{"id": 3, "x": [%s, 1, 2, 3]}' % digits
    lines[4] = '{"id": %s, "x": [1, 1, 2, 3]}' % digits
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    result = cli("run", spec, "-q")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    rejects = [json.loads(x) for x in (tmp_path / "out/rejects.jsonl").read_text().splitlines()]
    long = [r for r in rejects if "digits" in r["reason"]]
    assert [r["index"] for r in long] == [3, 4]
    assert all(r["where"].endswith(f"data.jsonl:{r['index'] + 1}") for r in long), long
    assert f"more than {sys.get_int_max_str_digits()} digits" in long[0]["reason"]
    t = manifest(tmp_path / "out")["totals"]
    assert t["records_in"] == 40 == t["records_out"] + t["records_rejected"]


def test_an_input_failing_to_read_is_named_and_resume_completes(tmp_path, monkeypatch):
    import graphrun.read.formats.jsonl as jsonl

    spec = make_job(tmp_path, n=400)
    assert cli("run", spec, "-q", "--out", tmp_path / "clean").exit_code == 0
    blocks = jsonl._blocks

    def failing(f, file, start, stop, block_bytes):  # the disk fails after some blocks
        for k, block in enumerate(blocks(f, file, start, stop, 2048)):
            if k == 6:
                raise OSError(errno.EIO, "Input/output error")
            yield block

    # a patch: the CLI builds its own reader, reached only through the command
    monkeypatch.setattr(jsonl, "_blocks", failing)
    result = cli("run", spec, "-q")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "data.jsonl: reading the input file failed: Input/output error" in result.output
    assert "--resume" in result.output and "writing" not in result.output
    assert manifest(tmp_path / "out")["status"] == "failed"
    monkeypatch.setattr(jsonl, "_blocks", blocks)
    result = cli("run", spec, "-q", "--resume")
    assert result.exit_code == 0, result.output
    check_equals_clean(tmp_path / "out", tmp_path / "clean")


def test_a_full_disk_names_the_free_space_left(tmp_path, monkeypatch):
    import graphrun.write.shards as shards
    import graphrun.write.sinks.npy as npy

    spec = make_job(tmp_path, n=400)
    real = npy.pwrite_all
    calls = []

    def full(fd, data, offset):  # the disk fills after a few shards' rows
        calls.append(1)
        if len(calls) > 12:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    # The CLI builds its own writer: its steps on the disk are the module's DiskSteps().
    monkeypatch.setattr(shards, "DiskSteps", partial(shards.DiskSteps, pwrite=full))
    result = cli("run", spec, "-q")
    assert result.exit_code == 2 and "Traceback" not in result.output
    device, mount = df(tmp_path)
    said = " ".join(result.output.split())  # the message as one line, unwrapped
    assert f"No space left on device (the filesystem holding it, {device}" in said
    assert f"mounted at {mount}, has " in said and " free of " in said
    assert f"free space on {mount} (delete or move files off that filesystem), then run the " \
        "same command again with --resume" in said
    assert manifest(tmp_path / "out")["error"].startswith(f"writing {tmp_path / 'out'} failed")


def df(path) -> tuple[str, str]:
    """(the device, the mount point) of the filesystem holding path, as df says."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("df") is None:
        pytest.skip("no df here")
    last = subprocess.run(["df", "-P", str(path)], capture_output=True, text=True,
                          check=True).stdout.splitlines()[-1].split()
    return last[0], last[-1]


def test_a_full_disk_at_commit_names_the_disk_too(tmp_path, monkeypatch):
    """A full disk met on the committer (the journal's append), not by the writer's rows."""
    import graphrun.write.journal as journal
    import graphrun.write.shards as shards

    spec = make_job(tmp_path, n=400)
    real, calls = journal.append_journal, []

    def full(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    # The CLI builds its own writer: its steps on the disk are the module's DiskSteps().
    monkeypatch.setattr(shards, "DiskSteps", partial(shards.DiskSteps, append_journal=full))
    result = cli("run", spec, "-q")
    assert result.exit_code == 2 and "Traceback" not in result.output
    device, mount = df(tmp_path)
    said = " ".join(result.output.split())
    assert f"the filesystem holding it, {device}" in said and f"free space on {mount}" in said
    monkeypatch.undo()
    assert cli("run", spec, "-q", "--resume").exit_code == 0
