"""A generation job's finished.jsonl (write/finished.py): completions kept as they finish, taken
back by --resume instead of generated again; and the feed that refills slots on the CPU too."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from graphrun.cli.main import main
from graphrun.write import finished
from graphrun.write.finished import FINISHED, FinishedLog
from tests.children import child_env
from tests.test_generate_job import completions, write_spec


def fields(*tokens, logprobs=None) -> dict:
    return {"token_ids": list(tokens), "finish_reason": "eos", "logprobs": logprobs}


def kept_log(folder, key="run-a", start=0, committed=lambda: 0) -> FinishedLog:
    return FinishedLog.open(folder, lambda: key, start, committed, flush_s=0.01)


def test_a_run_takes_back_its_own_whole_records_from_where_it_reads(tmp_path):
    log = kept_log(tmp_path)
    log.add(5, 1, 0, fields(7, 8, logprobs=[-math.inf, -0.25]))
    log.add(3, 2, 1, fields(1))
    log.add(3, 2, 0, fields(2))
    log.add(9, 2, 1, fields(4))  # one of its two samples only
    log.add(6, 2, 0, fields(6))
    log.add(6, 2, 1, fields(6, 6))
    log.close(completed=False)
    with open(tmp_path / FINISHED, "ab") as f:
        f.write(b'{"h":"00","e":{"i":11,"n":1,"s":0,"c":{"tok')  # torn by a kill mid-append

    again = kept_log(tmp_path, start=4)  # a resume reading from ordinal 4
    taken = again.take(5, 1)
    assert taken[0]["token_ids"] == [7, 8] and taken[0]["logprobs"][0] == -math.inf
    assert taken[0]["logprobs"][1] == -0.25
    assert again.take(5, 1) is None  # given back once
    assert again.take(3, 2) is None  # below where the resume reads
    assert again.take(9, 2) is None  # a sample missing: generated again, whole
    assert again.take(11, 1) is None  # its line torn
    assert again.take(6, 1) is None  # asked another number of samples than were kept
    assert again.taken == 1
    # the file was started again with the whole records from 4 on, kept until a commit
    lines = (tmp_path / FINISHED).read_text().splitlines()
    assert json.loads(lines[0]) == {"run": "run-a"}
    assert sorted((json.loads(x)["e"]["i"], json.loads(x)["e"]["s"]) for x in lines[1:]) == [
        (5, 0), (6, 0), (6, 1)]
    again.close(completed=False)


def test_an_edited_or_foreign_line_is_generated_again(tmp_path):
    log = kept_log(tmp_path, key="run-a")
    log.add(0, 1, 0, fields(1, 2))
    log.add(1, 1, 0, fields(3))
    log.close(completed=False)
    text = (tmp_path / FINISHED).read_text()
    (tmp_path / FINISHED).write_text(text.replace('"token_ids":[1,2]', '"token_ids":[1,9]'))
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    other = kept_log(elsewhere, key="run-b")
    other.add(2, 1, 0, fields(5))
    other.close(completed=False)
    with open(tmp_path / FINISHED, "a") as f:  # another run's line spliced in
        f.write((elsewhere / FINISHED).read_text().splitlines()[1] + "\n")
    again = kept_log(tmp_path, key="run-a")
    assert again.take(0, 1) is None and again.take(2, 1) is None
    assert again.take(1, 1)[0]["token_ids"] == [3]
    again.close(completed=False)


def test_another_runs_completions_are_never_taken_back(tmp_path):
    log = kept_log(tmp_path, key="run-a")
    log.add(0, 1, 0, fields(1))
    log.close(completed=False)
    other = kept_log(tmp_path, key="run-b")  # another spec, input, model or slice
    assert other.take(0, 1) is None
    assert not (tmp_path / FINISHED).exists()
    other.close(completed=False)


@pytest.mark.parametrize("kind", ["folder", "fifo", "temp folder"])
def test_a_finished_file_that_cannot_be_read_stops_the_keeping_not_the_run(tmp_path, kind):
    # used to fail the run at its start (a folder: "Is a directory") or hang it (a fifo)
    if kind == "folder":
        (tmp_path / FINISHED).mkdir()
    elif kind == "fifo":
        os.mkfifo(tmp_path / FINISHED)
    else:
        log = kept_log(tmp_path)
        log.add(0, 1, 0, fields(1))
        log.close(completed=False)
        (tmp_path / finished.FINISHED_TMP).mkdir()
    opened = []
    thread = threading.Thread(target=lambda: opened.append(kept_log(tmp_path)), daemon=True)
    thread.start()
    thread.join(10)
    assert opened, "opening the log hung"
    log = opened[0]
    assert log.error is not None
    log.add(1, 1, 0, fields(2))
    log.close(completed=True)  # what is not a regular file is left where it is
    assert (tmp_path / (finished.FINISHED_TMP if kind == "temp folder" else FINISHED)).exists()


def test_records_taken_back_are_counted_but_left_out_of_the_progress_rate(tmp_path):
    # a resume's taken-back records finish at once: counted in the rate, they made its ETA
    # promise the rest at that speed too
    import io

    from graphrun.job.progress import ProgressLines

    log = kept_log(tmp_path)
    for i in (4, 5, 6):
        log.add(i, 1, 0, fields(i))
    log.close(completed=False)
    again = kept_log(tmp_path, start=4)
    assert all(again.take(i, 1) for i in (4, 5, 6))
    assert again.given_among([3, 4, 5], low=5) == 1 and again.given_among([4, 5, 6]) == 1
    again.close(completed=False)
    lines = ProgressLines(total=1000, out=io.StringIO())
    lines.advance(400, taken_back=300)
    text = lines.line(10.0).split(" ", 1)[1]
    assert text == "graphrun: 400/1,000 records (40%), 10 records/s, ETA 0:01:00"


def test_what_a_commit_covers_is_dropped_and_a_completed_run_leaves_no_file(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setattr(finished, "REWRITE_BYTES", 0)  # rewritten as soon as it may shrink
    committed = [0]
    log = kept_log(tmp_path, committed=lambda: committed[0])
    for i in range(12):
        log.add(i, 1, 0, fields(i))
    log._flush()
    committed[0] = 10  # a shard holding 0..9 was journaled
    log.add(12, 1, 0, fields(12))
    log._flush()
    kept = [json.loads(x)["e"]["i"]
            for x in (tmp_path / FINISHED).read_text().splitlines()[1:]]
    assert kept == [10, 11, 12]
    log.close(completed=True)
    assert not (tmp_path / FINISHED).exists()


def interrupt_once_kept(spec, out, signum) -> "Path":
    """Run spec into out and send signum once finished.jsonl holds 4 records, before any
    commit (one window of every prompt); its path."""
    proc = subprocess.Popen([sys.executable, "-m", "graphrun", "run", str(spec), "--out",
                             str(out), "-q"], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    log, deadline = out / FINISHED, time.monotonic() + 120
    while not log.exists() or log.read_bytes().count(b"\n") < 5:  # the header and 4 records
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no completion was kept"
        time.sleep(0.01)
    proc.send_signal(signum)
    proc.communicate()
    assert not (out / "journal.jsonl").exists()  # nothing committed
    return log


@pytest.mark.slow
def test_kill_9_before_any_commit_then_resume_takes_back_what_finished(tmp_path):
    # one window of every prompt (group_by_length): nothing is written, so nothing commits,
    # before the last of them finishes; an interrupt used to lose every completion
    sampled = {"method": "sample", "temperature": 1.0, "seed": 1}
    clean = tmp_path / "clean"
    clean.mkdir()
    spec = write_spec(clean, n=48, data__group_by_length=48,
                      generate={"max_new_tokens": 48, "sampling": sampled})
    ran = CliRunner().invoke(main, ["run", str(spec), "-q"])
    assert ran.exit_code == 0, ran.output
    assert not (clean / "out" / FINISHED).exists()  # a completed run keeps none

    out = tmp_path / "killed"
    log = interrupt_once_kept(spec, out, signal.SIGKILL)

    resumed = CliRunner().invoke(main, ["run", str(spec), "--out", str(out), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert completions(out) == completions(clean / "out")
    gen = json.loads((out / "manifest.json").read_text())["generation"]
    assert gen["records_taken_back"] >= 4
    assert gen["records"] + gen["records_taken_back"] == 48
    assert f"{gen['records_taken_back']} records' completions taken back" in resumed.output
    assert not log.exists()


@pytest.mark.slow
def test_a_plain_rerun_after_an_interrupt_before_any_commit_takes_back_what_finished(tmp_path):
    # SIGINT before the first commit: the attempt says interrupted and a plain rerun starts
    # over in its folder, which used to delete its finished completions with the rest (a
    # stop lets the parts in flight finish: enough prompts that the window does not)
    spec = write_spec(tmp_path, n=160, data__group_by_length=160,
                      generate={"max_new_tokens": 48,
                                "sampling": {"method": "sample", "temperature": 1.0, "seed": 1}})
    clean = CliRunner().invoke(main, ["run", str(spec), "-q", "--out", str(tmp_path / "clean")])
    assert clean.exit_code == 0, clean.output
    out = tmp_path / "out"
    log = interrupt_once_kept(spec, out, signal.SIGINT)
    assert json.loads((out / "manifest.json").read_text())["status"] == "interrupted"
    assert log.exists()
    rerun = CliRunner().invoke(main, ["run", str(spec), "-q"])  # no --resume
    assert rerun.exit_code == 0, rerun.output
    assert json.loads((out / "manifest.json").read_text())["generation"][
        "records_taken_back"] >= 4
    assert completions(out) == completions(tmp_path / "clean")
    assert not log.exists()


def test_a_cpu_generation_job_refills_slots_as_a_gpu_one_does(tmp_path):
    # stop ids end most rows early: serially one part of 4 runs at a time, each until its
    # longest row ends; overlapped, a freed slot takes the next prompt
    spec = write_spec(tmp_path, n=32, data__group_by_length=None,
                      generate={"max_new_tokens": 32, "stop": {"token_ids": list(range(3, 40))},
                                "sampling": {"method": "sample", "temperature": 1.0,
                                             "seed": 1}})
    runs = {}
    for way, env in (("default", {}), ("serial", {"GRAPHRUN_OVERLAP": "off"})):
        ran = CliRunner().invoke(main, ["run", str(spec), "-q", "--out",
                                        str(tmp_path / way)], env=env)
        assert ran.exit_code == 0, ran.output
        runs[way] = json.loads((tmp_path / way / "manifest.json").read_text())
    default, serial = runs["default"], runs["serial"]
    assert default["totals"]["overlapped"] is True
    assert "the default for generation" in default["totals"]["overlap_reason"]
    assert completions(tmp_path / "default") == completions(tmp_path / "serial")
    steps = {way: m["generation"]["decode_steps"] for way, m in runs.items()}
    assert steps["default"] < 0.8 * steps["serial"], steps
    assert (default["generation"]["waste"]["no_prompt"]
            < serial["generation"]["waste"]["no_prompt"])
