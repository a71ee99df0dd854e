"""The command line's exit (fast_exit.py): once done and flushed it skips the interpreter's
teardown, keeps its exit code and output, and exits normally where the teardown could matter."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest

from graphrun.cli.fast_exit import normal_exit_reason
from tests.children import child_env
from tests.conftest import MLP_SPEC

# `python -m graphrun ARGS` with an exit hook that says whether the interpreter's teardown ran
MAIN = ("import atexit, runpy, sys; atexit.register(print, 'teardown ran', flush=True); "
        "sys.argv = ['graphrun', *sys.argv[1:]]; runpy.run_module('graphrun', "
        "run_name='__main__')")


def graphrun(*args, **env):
    return subprocess.run([sys.executable, "-c", MAIN, *map(str, args)], capture_output=True,
                          text=True, env={**child_env(), **env}, timeout=120)


@pytest.mark.slow
def test_a_run_ends_without_the_teardown_with_its_output_and_files(write_spec, tmp_path):
    proc = graphrun("run", write_spec())
    assert proc.returncode == 0, proc.stderr
    assert "teardown ran" not in proc.stdout
    last = proc.stdout.rstrip().splitlines()[-1]  # the summary's last line, flushed to a pipe
    assert last.startswith("completed: 10 records out"), proc.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["totals"]["records_out"] == 10


def test_an_error_keeps_its_exit_code_and_message(write_spec):
    proc = graphrun("run", write_spec(MLP_SPEC.replace("builtin: mlp", "builtin: nope")))
    assert proc.returncode == 2
    assert "model.builtin: unknown builtin 'nope'" in proc.stderr
    assert "teardown ran" not in proc.stdout


@pytest.mark.slow
def test_graphrun_slow_exit_keeps_the_teardown(write_spec):
    proc = graphrun("run", write_spec(), "-q", GRAPHRUN_SLOW_EXIT="1")
    assert proc.returncode == 0, proc.stderr
    assert "teardown ran" in proc.stdout


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_live_multiprocessing_child_keeps_the_normal_exit():
    child = multiprocessing.get_context("spawn").Process(target=_sleep, args=(30,))
    child.start()
    try:
        assert normal_exit_reason() == "a multiprocessing child is alive"
    finally:
        child.terminate()
        child.join()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="children are found through /proc")
def test_a_live_child_process_keeps_the_normal_exit():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert normal_exit_reason() == "a child process is alive"
    finally:
        child.kill()
        child.wait()


def test_a_running_thread_that_is_no_daemon_keeps_the_normal_exit():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, args=(30,), daemon=False)
    worker.start()
    try:
        reason = normal_exit_reason()
        assert reason is not None and ("thread" in reason or "child" in reason)
    finally:
        stop.set()
        worker.join()


def test_slow_exit_variable_is_read(monkeypatch):
    monkeypatch.setenv("GRAPHRUN_SLOW_EXIT", "1")
    assert normal_exit_reason() == "GRAPHRUN_SLOW_EXIT is set"
