"""The runner under attack: hostile specs and inputs, output folders it does not own, forged
journals, concurrent runs, a full disk, signals at bad times, kill -9 at random points. Each
test asserts that nothing is lost and that the user gets one clear message, not a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from graphrun.base.errors import OutputError, SpecError
from graphrun.spec.load import load_spec
from tests.children import child_env

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, cwd=None, timeout=120):
    env = child_env()
    return subprocess.run([sys.executable, "-m", "graphrun", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_message(proc) -> str:
    """The CLI failed with one message and no traceback."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(("error: ", "graphrun: ")) or "invalid" in proc.stderr, \
        proc.stderr
    return proc.stderr


# ---- hostile YAML ------------------------------------------------------------------------------

def test_an_alias_bomb_is_refused_located_and_fast(write_spec, tmp_path):
    lines = ["a0: &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecError, match=r"bomb.yaml:1:\d+: a\d.*more than 100,000 values"):
        load_spec(path)


def test_a_self_referring_alias_is_refused_located(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("version: 1\nr: &r [*r]\n")
    with pytest.raises(SpecError, match=r"r.yaml:2:4: r\[0\]: an alias refers to a node that "
                                        "contains it"):
        load_spec(path)


def test_a_self_referring_alias_in_an_override_is_refused(write_spec):
    spec = write_spec()
    with pytest.raises(SpecError, match=r"--set model.args=\{a: &a \[\*a\]\}: model.args: .*"
                                        "cycle"):
        load_spec(spec, ["model.args={a: &a [*a]}"])


# ---- a small job, run in this process ----------------------------------------------------------

SPEC = """\
version: 1
name: attack
device: cpu
model:
  target: model.py:build
  args: {}
inputs:
  x: {shape: [batch, 4], dtype: float32}
outputs:
  y: {shape: [batch, 3]}
buckets:
  batch: [1, 2, 4]
capture:
  warmup_iters: 1
data:
  path: data.jsonl
  batch_size: 4
output:
  dir: out
  format: FORMAT
  rows_per_file: 3
"""

MODEL = """\
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x)


def build():
    torch.manual_seed(0)
    return Net()
"""


def make_job(folder: Path, n: int = 20, fmt: str = "npy", data: str | None = None,
             extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(MODEL)
    (folder / "data.jsonl").write_text(data if data is not None else "".join(
        f'{{"x": [{i}, 1, 2, 3]}}\n' for i in range(n)))
    spec = folder / "pipeline.yaml"
    spec.write_text(SPEC.replace("FORMAT", fmt) + extra)
    return spec


def run_job(spec_path: Path, out: Path, **kw):
    import graphrun
    return graphrun.run(load_spec(spec_path), out=out, overlap=kw.pop("overlap", False), **kw)


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("part-*"))}


# ---- 1. own only what graphrun wrote -----------------------------------------------------------

def test_overwrite_and_resume_never_delete_a_users_files_named_like_graphrun_s(tmp_path):
    spec = make_job(tmp_path)
    out = tmp_path / "out"
    run_job(spec, out)
    mine = {"part-1-of-my-thesis.docx": b"years", ".secret.tmp": b"key",
            "part-notes-for-boss.txt": b"notes", "part-00000.docx": b"x"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    run_job(spec, out, resume=True)  # a completed run's folder: resumed, nothing to do
    with pytest.raises(OutputError, match=r"holds files graphrun did not write \(\.secret\.tmp, "
                                          r"part-00000\.docx, part-1-of-my-thesis\.docx"):
        run_job(spec, out, overwrite=True)
    assert {n: (out / n).read_bytes() for n in mine} == mine


def test_a_folder_without_graphrun_s_mark_is_never_overwritten(tmp_path):
    spec = make_job(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("manifest.json", "journal.jsonl", "part-00000.ids.npy", "run.json"):
        (out / name).write_text("[1, 2]")  # graphrun's names, not graphrun's files
    with pytest.raises(OutputError, match="did not write"):
        run_job(spec, out, overwrite=True)
    with pytest.raises(OutputError, match=r"run.json is not a run.json graphrun wrote"):
        run_job(spec, out, resume=True)
    assert all((out / n).read_text() == "[1, 2]" for n in os.listdir(out))


def test_an_output_folder_holding_the_input_is_refused_even_with_overwrite(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    spark = data / "part-00000-c0ffee.snappy.parquet"
    spark.write_bytes(b"PAR1 the input PAR1")
    spec = make_job(tmp_path, extra="")
    spec.write_text(spec.read_text().replace("data.jsonl", "data/part-00000-c0ffee.snappy."
                                             "parquet").replace("dir: out", "dir: data"))
    for flags in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(OutputError, match="holds the input file"):
            import graphrun
            graphrun.run(load_spec(spec), **flags)
    assert spark.read_bytes() == b"PAR1 the input PAR1"
    assert sorted(os.listdir(data)) == [spark.name]


# ---- 2. the resume fingerprint covers the model ------------------------------------------------

def test_resume_refuses_changed_weights_and_a_changed_target_module(tmp_path):
    import torch
    spec = make_job(tmp_path)
    net = torch.nn.Linear(4, 3)
    torch.save({"lin." + k: v for k, v in net.state_dict().items()}, tmp_path / "w.pt")
    spec.write_text(spec.read_text().replace("args: {}", "args: {}\n  weights: w.pt"))
    out = tmp_path / "out"
    run_job(spec, out)
    with torch.no_grad():
        net.weight.add_(1)
    torch.save({"lin." + k: v for k, v in net.state_dict().items()}, tmp_path / "w.pt")
    with pytest.raises(OutputError, match=r"the model's weights file \S*w\.pt changed since "
                       r"the run started\. If the change does not alter outputs .* add "
                       r"--accept-model-change; otherwise use --overwrite"):
        run_job(spec, out, resume=True)
    run_job(spec, out, overwrite=True)
    (tmp_path / "model.py").write_text(MODEL.replace("manual_seed(0)", "manual_seed(1)"))
    with pytest.raises(OutputError, match=r"the model's source file \S*model\.py changed"):
        run_job(spec, out, resume=True)
    spec.write_text(spec.read_text().replace("name: attack", "name: other"))
    with pytest.raises(OutputError, match=r"holds a different run \(the model's "
                       r"source file \S*model\.py changed; name was \"attack\", now \"other\""):
        run_job(spec, out, resume=True, accept_model_change=True)  # not only the model


def test_a_local_hugging_face_folder_is_part_of_the_model_fingerprint(tmp_path):
    from types import SimpleNamespace
    from graphrun.write.folder import model_files
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    model = SimpleNamespace(weights=None, exported=None, torchscript=None, target=None,
                            hf=SimpleNamespace(path="tiny"))
    assert model_files(model, tmp_path) == {"hf/config.json": folder / "config.json",
                                            "hf/model.safetensors": folder / "model.safetensors"}
    model.hf.path = "someone/hub-model"  # a hub name: its cache is not ours to hash
    assert model_files(model, tmp_path) == {}


# ---- 3. the journal is verified on resume ------------------------------------------------------

def _forge(out: Path, how: str) -> None:
    path = out / "journal.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    last = lines[-1]
    if how == "next_index+300":
        last["next_index"] += 300
    elif how == "next_index-300":
        last["next_index"] -= 300
    elif how == "shard-3":
        last["shard"] -= 3
    elif how == "appended":
        lines.append(dict(last, shard=last["shard"] + 1))
    elif how == "resealed":  # a forger who recomputes the checksum still breaks the counts
        from graphrun.write.journal import line_digest
        last["next_index"] += 300
        last["sha256"] = line_digest(lines[-2]["sha256"] if len(lines) > 1 else "", last)
    elif how == "dropped":
        del lines[1]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.parametrize("how", ["next_index+300", "next_index-300", "shard-3", "appended",
                                 "resealed", "dropped"])
def test_a_forged_journal_is_refused_and_nothing_is_deleted(tmp_path, how):
    spec = make_job(tmp_path, n=20)
    out = tmp_path / "out"
    run_job(spec, out)
    before = shard_bytes(out)
    _forge(out, how)
    with pytest.raises(OutputError, match=r"journal.jsonl:\d+ is not a journal line graphrun "
                                          r"wrote \(.+\); .*--overwrite"):
        run_job(spec, out, resume=True)
    assert shard_bytes(out) == before


def test_a_rejects_file_shorter_in_lines_than_the_journal_says_is_refused(tmp_path):
    data = "".join(f'{{"x": [{i}, 1, 2, 3]}}\n' if i % 3 else "nonsense\n" for i in range(20))
    spec = make_job(tmp_path, data=data)
    spec.write_text(spec.read_text().replace("batch_size: 4", "batch_size: 4\n"
                                             "  on_bad_record: skip"))
    out = tmp_path / "out"
    run_job(spec, out)
    rejects = (out / "rejects.jsonl").read_bytes()
    # the same bytes, one line fewer: two rejects merged into one line
    (out / "rejects.jsonl").write_bytes(rejects.replace(b"}\n", b"} ", 1) + b"\n")
    with pytest.raises(OutputError, match=r"rejects.jsonl holds \d+ rejects where"):
        run_job(spec, out, resume=True)


# ---- 4. one run per folder ---------------------------------------------------------------------

def test_a_second_run_on_a_locked_folder_is_refused_naming_the_first_s_pid(tmp_path):
    spec = make_job(tmp_path)
    out = tmp_path / "out"
    run_job(spec, out)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(out)!r}, os.O_RDONLY)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        for flags in ({"resume": True}, {"overwrite": True}, {}):
            with pytest.raises(OutputError, match=rf"in use by another graphrun run \(pid "
                                                  rf"{holder.pid}\)"):
                run_job(spec, out, **flags)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    finally:
        holder.kill()
        holder.wait()
    run_job(spec, out, resume=True)  # the lock went with its holder


@pytest.mark.slow
def test_two_cli_resumes_at_once_one_is_refused_and_the_run_is_whole(tmp_path):
    spec = make_job(tmp_path, n=400)
    out = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, "-m", "graphrun", "run", str(spec), "--out",
                               str(out), "--resume", "-q"], env=child_env(),
                              stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    codes = sorted(p.returncode for p in procs)
    if codes == [0, 0]:  # the first ended before the second looked: run in turn, both fine
        pass
    else:
        assert codes == [0, 2], errors
        assert any("in use by another graphrun run (pid" in e for e in errors), errors
    lines = (out / "journal.jsonl").read_text().splitlines()
    assert len(lines) == 400 // 3 + 1
    ids = np.concatenate([np.load(p) for p in sorted(out.glob("part-*.ids.npy"))])
    assert ids.tolist() == list(range(400))


# ---- 5. a full disk ----------------------------------------------------------------------------

class DiskFull:
    """A disk that holds `budget` more bytes under `folder`: os.write, os.pwrite and files
    opened for writing by open() fail with ENOSPC past it (pyarrow writes on its own, so the
    tests use npy and jsonl). spent counts what was written."""

    def __init__(self, monkeypatch, folder: Path, budget: float):
        import builtins
        self.folder, self.budget, self.spent = str(folder), budget, 0
        real_open, real_write, real_pwrite = builtins.open, os.write, os.pwrite
        disk = self

        class Full:
            def __init__(self, f):
                self._f = f

            def write(self, data):
                disk.spend(len(data))
                return self._f.write(data)

            def __getattr__(self, name):
                return getattr(self._f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._f.close()

        def full_open(file, mode="r", *a, **k):
            f = real_open(file, mode, *a, **k)
            ours = (mine(file) if isinstance(file, int)  # a descriptor: base/nofollow.py's
                    else isinstance(file, (str, Path)) and str(file).startswith(disk.folder))
            return Full(f) if ours and any(c in mode for c in "wax+") else f

        def mine(fd):
            try:
                return os.readlink(f"/proc/self/fd/{fd}").startswith(disk.folder)
            except OSError:
                return False

        def write(fd, data):
            if mine(fd):
                disk.spend(len(data))
            return real_write(fd, data)

        def pwrite(fd, data, offset):
            if mine(fd):
                disk.spend(len(data))
            return real_pwrite(fd, data, offset)

        # patches: a full disk is the environment's (open, os.write, os.pwrite)
        monkeypatch.setattr(builtins, "open", full_open)
        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "pwrite", pwrite)

    def spend(self, n: int) -> None:
        if self.spent + n > self.budget:
            raise OSError(28, "No space left on device")
        self.spent += n


MARGIN = 512  # bytes: well past what the manifest's numbers vary by, short of its length


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["npy", "jsonl"])
def test_a_full_disk_at_any_point_fails_with_one_message_and_resume_completes(
        tmp_path, monkeypatch, fmt):
    spec = make_job(tmp_path, n=40, fmt=fmt)
    clean = tmp_path / "clean"
    with monkeypatch.context() as m:
        total = DiskFull(m, clean, float("inf"))
        run_job(spec, clean)
    want = shard_bytes(clean)
    for k, fraction in enumerate((0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 0.97,
                                  0.99, 0.995, 0.999)):
        out = tmp_path / f"full{k}"
        with monkeypatch.context() as m:
            # never within MARGIN of the whole: the manifest's timings and rates are not
            # the same length from run to run, and a budget a few bytes short of the clean
            # run's total may hold all of another run
            DiskFull(m, out, int(min(total.spent * fraction, total.spent - MARGIN)))
            with pytest.raises(OutputError, match=r"No space left on device.*(--resume|folder)"):
                run_job(spec, out)
        # what is committed is intact, and nothing stray blocks the next run
        assert not (out / "manifest.json.tmp").exists()
        if fraction == 0.0:  # not even run.json: the folder is new again
            run_job(spec, out, overwrite=True)
        else:
            run_job(spec, out, resume=True)
        assert shard_bytes(out) == want, fraction
        assert json.loads((out / "manifest.json").read_text())["status"] == "completed"


def test_a_full_disk_when_latencies_are_written_at_a_shard_s_hand_over(tmp_path):
    from graphrun.job.parts import JobParts
    from graphrun.write.latencies import open_latencies
    spec = make_job(tmp_path, n=40)
    out = tmp_path / "out"
    calls = []

    def filling(*a, **k):  # latencies.jsonl on a disk that fills at its third flush
        log = open_latencies(*a, **k)
        real = log.flush

        def flush():
            calls.append(1)
            if len(calls) == 3:
                raise OSError(28, "No space left on device")
            real()

        log.flush = flush
        return log

    with pytest.raises(OutputError, match=r"No space left on device.*--resume"):
        run_job(spec, out, parts=JobParts(open_latencies=filling))
    run_job(spec, out, resume=True)
    clean = tmp_path / "clean"
    run_job(spec, clean)
    assert shard_bytes(out) == shard_bytes(clean)


def test_a_full_disk_while_the_manifest_is_written_fails_cleanly(tmp_path):
    from graphrun.job.parts import JobParts
    from graphrun.manifest import keys
    spec = make_job(tmp_path)
    out = tmp_path / "out"

    def full(manifest, path):
        Path(f"{path}.tmp").write_text("{half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OutputError, match=r"manifest.json failed: .*No space left"):
        run_job(spec, out, parts=JobParts(write_manifest=full))
    assert not (out / "manifest.json.tmp").exists()
    run_job(spec, out, resume=True)
    assert keys.Manifest.model_validate_json((out / "manifest.json").read_text())


# ---- 12. latencies.jsonl across a crash --------------------------------------------------------

def test_every_committed_batch_has_its_latency_line_on_disk_before_its_journal_line(
        tmp_path):
    """What a kill -9 leaves is what is on disk at that moment: so at each journal append, the
    lines of every batch below the line's re-read point must be in latencies.jsonl, numbered
    1, 2, 3, ... (a resume keeps those and logs the rest again)."""
    from functools import partial

    from graphrun.job.parts import JobParts
    from graphrun.write.journal import append_journal
    from graphrun.write.shards import DiskSteps, ShardWriter
    spec = make_job(tmp_path, n=200)
    out = tmp_path / "out"
    real, checked = append_journal, []

    def append(out_dir, shard, files, rows, next_index, rejects_bytes, rejects, read_from, **k):
        # only whole lines: the writer's thread may be writing a later hand-over's lines now,
        # and a line it has half written is of a batch at or above this re-read point
        text = (out_dir / "latencies.jsonl").read_text()
        lines = [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines()]
        firsts = [x["first"] for x in lines]
        assert [x["batch"] for x in lines] == list(range(1, len(lines) + 1))
        assert firsts[:len([f for f in firsts if f < read_from])] == list(range(0, read_from, 4))
        checked.append(shard)
        return real(out_dir, shard, files, rows, next_index, rejects_bytes, rejects, read_from,
                    **k)

    run_job(spec, out, parts=JobParts(
        writer=partial(ShardWriter, disk=DiskSteps(append_journal=append))))
    assert len(checked) == 67


# ---- 6, 7. signals at bad times ----------------------------------------------------------------

def test_abort_after_finish_closes_no_descriptor_twice(tmp_path):
    from graphrun.write.sinks.npy import NpySink
    from graphrun.base.tuning import Tuning
    sink = NpySink(tmp_path, "part-00000", 4, {"y": (3,)}, Tuning())
    sink.add([0, 1], {"y": np.zeros((2, 3), np.float32)})
    sink.finish()
    with open(tmp_path / "unrelated", "wb") as other:  # may reuse the closed number
        sink.abort()
        os.fstat(other.fileno())  # still open
        other.write(b"still mine")
    assert (tmp_path / "unrelated").read_bytes() == b"still mine"


def test_closing_the_reader_while_another_thread_is_in_next_waits_for_it():
    import threading
    import time
    from graphrun.read.stream import ReadAhead
    inside, release = threading.Event(), threading.Event()

    def batches():
        yield 0
        inside.set()
        release.wait(10)
        yield 1

    ahead = ReadAhead(batches())
    assert next(ahead) == 0
    got = []
    consumer = threading.Thread(target=lambda: got.append(next(ahead)))
    consumer.start()
    assert inside.wait(10)  # the reading thread is in the source, one item ahead
    deadline = time.monotonic() + 10
    while not ahead._inside and time.monotonic() < deadline:  # and the consumer in next()
        time.sleep(0.01)
    threading.Timer(0.2, release.set).start()
    t0 = time.perf_counter()
    ahead.close()  # was: ValueError: generator already executing
    consumer.join(10)
    assert got == [1] and time.perf_counter() - t0 >= 0.1


def _python(code: str, *args, timeout=120):
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=child_env())


def test_sigint_while_the_spec_loads_exits_130_with_one_line(tmp_path):
    spec = make_job(tmp_path)
    proc = _python("import os, signal, sys\n"
                   "import graphrun.spec.load as s\n"
                   "real = s.load_spec\n"
                   "def load(*a):\n"
                   "    os.kill(os.getpid(), signal.SIGINT)\n"
                   "    return real(*a)\n"
                   "s.load_spec = load\n"
                   "from graphrun.cli.main import main\n"
                   "main(['run', sys.argv[1], '-q'])\n", spec)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == ("graphrun: interrupted by SIGINT before the run started; nothing "
                           "was written\n")


def test_sigint_in_an_exit_handler_after_the_run_leaves_no_traceback(tmp_path):
    spec = make_job(tmp_path)
    proc = _python("import atexit, os, signal, sys\n"
                   "from graphrun.cli.main import main\n"
                   "atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n"
                   "main(['run', sys.argv[1], '-q'])\n", spec)
    assert proc.returncode in (-signal_number("SIGINT"), 0), proc.stderr
    assert "KeyboardInterrupt" not in proc.stderr and "Traceback" not in proc.stderr


def signal_number(name: str) -> int:
    import signal
    return int(getattr(signal, name))


def test_sigterm_during_setup_stops_the_run_at_once(tmp_path):
    import signal
    import time
    from graphrun.engine import Runner
    from graphrun.job.parts import JobParts
    from graphrun.base.errors import Interrupted
    spec = make_job(tmp_path)

    class SlowSetup(Runner):
        def __init__(self, *a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # setup that would go on long after the signal
            super().__init__(*a, **k)

    t0 = time.perf_counter()
    with pytest.raises(Interrupted) as err:
        run_job(spec, tmp_path / "out", parts=JobParts(runner=SlowSetup))
    assert time.perf_counter() - t0 < 10 and err.value.exit_code == 143
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["status"] == \
        "interrupted"


def test_setup_reports_each_bucket_as_it_is_ready(tmp_path):
    from graphrun.engine import Runner
    spec = load_spec(make_job(tmp_path), ["capture.lazy=false"])  # every bucket at start
    said = []
    with Runner(spec, log=said.append):
        pass
    assert [m for m in said if m.startswith("set up")] == [
        "set up batch=4 (1/3, eager)", "set up batch=2 (2/3, eager)",
        "set up batch=1 (3/3, eager)"]


def test_a_bucket_grid_past_the_limit_is_refused(tmp_path):
    spec = make_job(tmp_path)
    sizes = ", ".join(str(i) for i in range(1, 601))
    with pytest.raises(SpecError, match=r"buckets: 600 buckets, more than 512"):
        load_spec(spec, [f"buckets.batch=[{sizes}]"])


# ---- 11. one message, not a traceback ----------------------------------------------------------

def test_static_buffers_past_the_machine_s_memory_are_refused_with_the_figure(tmp_path,
                                                                             monkeypatch):
    from graphrun.spec import rules

    # a patch: the machine's memory, read while the spec loads, with no caller
    monkeypatch.setattr(rules, "_memory_bytes", lambda: 24 * 2**30)  # any machine's size
    spec = make_job(tmp_path)
    with pytest.raises(SpecError, match=r"buckets: the static buffers at the largest bucket "
                                        r"\(batch=2,147,483,647\) need 56\.0 GiB"):
        load_spec(spec, ["buckets.batch=[2147483647]"])


@pytest.mark.parametrize("device", ["cuda:128", "cuda:99999999999999999999"])
def test_a_cuda_index_torch_cannot_hold_is_refused(tmp_path, device):
    with pytest.raises(SpecError, match=rf"device: {device} names no device"):
        load_spec(make_job(tmp_path), [f"device={device}"])


def test_an_input_path_that_is_a_symlink_loop_is_refused(tmp_path):
    spec = make_job(tmp_path)
    (tmp_path / "a.jsonl").symlink_to(tmp_path / "b.jsonl")
    (tmp_path / "b.jsonl").symlink_to(tmp_path / "a.jsonl")
    with pytest.raises(SpecError, match=r"data.path: .*a.jsonl is a loop of symbolic links"):
        load_spec(spec, ["data.path=a.jsonl"])


def test_hostile_specs_give_one_line_from_the_cli(tmp_path):
    spec = make_job(tmp_path)
    # records of 4096 floats at 2**31 - 1 rows: more memory than any machine has
    huge = ["--set", "buckets.batch=[2147483647]", "--set", "inputs.x.shape=[batch,4096]"]
    for args in (["--set", "model.args={a: &a [*a]}"], huge,
                 ["--set", "device=cuda:99999999999999999999"]):
        proc = cli("run", spec, "-q", *args)
        assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1


# ---- 8, 9, 13. hostile JSON lines --------------------------------------------------------------

def _skip_job(tmp_path: Path, data: str, fmt: str = "parquet") -> Path:
    spec = make_job(tmp_path, data=data, fmt=fmt)
    spec.write_text(spec.read_text().replace("batch_size: 4", "batch_size: 4\n  id_field: id\n"
                                             "  on_bad_record: skip"))
    return spec


def _rejects(out: Path) -> dict[int, str]:
    return {r["index"]: r["reason"] for r in map(json.loads, (out / "rejects.jsonl").open())}


def _row(rid, x=1) -> str:
    return json.dumps({"id": rid, "x": [x, 1, 2, 3]}) + "\n"


@pytest.mark.parametrize("fmt", ["parquet", "npy", "jsonl"])
def test_an_id_utf8_cannot_hold_is_a_bad_record_and_resume_works(tmp_path, fmt):
    data = _row("a") + '{"id": "\\ud800", "x": [1, 1, 2, 3]}\n' + _row("b")
    spec = _skip_job(tmp_path, data, fmt)
    m = run_job(spec, tmp_path / "out")
    assert (m.totals.records_out, m.totals.records_rejected) == (2, 1)
    assert "lone surrogate" in _rejects(tmp_path / "out")[1]
    run_job(spec, tmp_path / "out", resume=True)


def test_a_line_nested_100000_deep_is_one_reject(tmp_path):
    deep = '{"id": "deep", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    spec = _skip_job(tmp_path, _row("a") + deep + _row("b"))
    m = run_job(spec, tmp_path / "out")
    assert (m.totals.records_out, m.totals.records_rejected) == (2, 1)
    assert "nested too deeply" in _rejects(tmp_path / "out")[1]


def test_ids_5_and_text_5_are_one_id(tmp_path):
    spec = _skip_job(tmp_path, _row(5) + _row("5") + _row("05") + _row(-0) + _row("-0"), "npy")
    m = run_job(spec, tmp_path / "out")
    assert (m.totals.records_out, m.totals.records_rejected) == (4, 1)
    assert _rejects(tmp_path / "out").keys() == {1}  # "5" after 5; "-0" is not 0's text
    assert "duplicate id" in _rejects(tmp_path / "out")[1]
    ids = [i for part in sorted((tmp_path / "out").glob("part-*.ids.npy"))
           for i in np.load(part).tolist()]
    assert ids == ["5", "05", "0", "-0"]


def test_ids_compare_as_text_across_chunks():
    from graphrun.read.ids import SeenIds, check_duplicate_ids
    seen = SeenIds()
    for chunk, dups in ((["5", "a"], {}), ([7, 5], {1: "duplicate id 5"}),
                        (["7", "05", "b"], {0: "duplicate id '7'"})):
        problems: dict = {}
        check_duplicate_ids(chunk, np.arange(len(chunk)), seen, problems)
        assert {p: m.split(":")[0] for p, m in problems.items()} == dups


def test_a_record_repeating_a_field_is_a_bad_record(tmp_path):
    twice = '{"id": "t", "x": [9, 9, 9, 9], "x": [1, 1, 2, 3]}\n'
    named_x = _row("x")  # the name inside a value: no repeat
    spec = _skip_job(tmp_path, _row("a") + twice + named_x + _row("b"))
    m = run_job(spec, tmp_path / "out")
    assert (m.totals.records_out, m.totals.records_rejected) == (3, 1)
    assert "field 'x' appears more than once" in _rejects(tmp_path / "out")[1]
    rejected = json.loads((tmp_path / "out" / "rejects.jsonl").read_text())
    assert rejected["id"] == "t"


@pytest.mark.parametrize("ending", ["\r", "\r\n", "\n"])
def test_cr_crlf_and_lf_line_endings_and_a_bom_read_the_same(tmp_path, ending):
    lines = [_row(f"r{i}", i).rstrip("\n") for i in range(30)]
    data = "\ufeff" + ending.join(lines) + ending
    spec = _skip_job(tmp_path, data, "jsonl")
    m = run_job(spec, tmp_path / "out")
    assert (m.totals.records_out, m.totals.records_rejected) == (30, 0)
    got = [json.loads(x)["id"] for p in sorted((tmp_path / "out").glob("part-*.jsonl"))
           for x in p.read_text().splitlines()]
    assert got == [f"r{i}" for i in range(30)]


# ---- kill -9 at random points: shards and latencies.jsonl as an uninterrupted run's ------------

def _latency_lines(out: Path) -> list[tuple]:
    lines = [json.loads(x) for x in (out / "latencies.jsonl").read_text().splitlines()]
    return [(x["batch"], x["first"], x["bucket"], x["records"]) for x in lines]


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_loses_nothing(tmp_path):
    import random
    import time
    spec = make_job(tmp_path, n=6000)
    spec.write_text(spec.read_text().replace("rows_per_file: 3", "rows_per_file: 100"))
    clean = tmp_path / "clean"
    assert run_job(spec, clean).status == "completed"  # in this process: the CLI's serial path
    rng = random.Random(21)
    mid_run = 0
    for trial in range(3):
        out = tmp_path / f"killed{trial}"
        proc = subprocess.Popen([sys.executable, "-m", "graphrun", "run", str(spec), "--out",
                                 str(out), "-q"], env=child_env(),
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not (out / "journal.jsonl").exists() and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.15))
        proc.kill()
        proc.wait()
        mid_run += not (out / "manifest.json").exists()  # killed before the end
        assert run_job(spec, out, resume=True).status == "completed"
        assert shard_bytes(out) == shard_bytes(clean)
        assert _latency_lines(out) == _latency_lines(clean)
    assert mid_run >= 2


def test_a_repeated_field_is_found_beside_a_record_missing_that_field(tmp_path):
    """One record lacks x and the next holds it twice: as many x's as lines in the block, so
    a count over the block alone would see no repeat."""
    missing = '{"id": "m"}\n'
    twice = '{"id": "t", "x": [9, 9, 9, 9], "x": [1, 1, 2, 3]}\n'
    spec = _skip_job(tmp_path, missing + twice + _row("b"), "jsonl")
    m = run_job(spec, tmp_path / "out")
    assert (m.totals.records_out, m.totals.records_rejected) == (1, 2)
    reasons = _rejects(tmp_path / "out")
    assert "field 'x' appears more than once" in reasons[1], reasons


@pytest.mark.parametrize("fmt", ["jsonl", "npy"])
def test_rejects_jsonl_is_strict_json_whatever_the_ids_held(tmp_path, fmt):
    orjson = pytest.importorskip("orjson")
    bad = ['{"id": NaN, "x": [1, 1, 2, 3]}\n', '{"id": Infinity, "x": [1, 1, 2, 3]}\n',
           '{"id": 1e400, "x": [1, 1, 2, 3]}\n', '{"id": "\\ud800", "x": [1, 1, 2, 3]}\n',
           '{"id": [NaN, "\\udfff"], "x": [1, 1, 2, 3]}\n']
    spec = _skip_job(tmp_path, _row("a") + "".join(bad) + _row("b"), fmt)
    m = run_job(spec, tmp_path / "out")
    assert (m.totals.records_out, m.totals.records_rejected) == (2, 5)
    lines = (tmp_path / "out" / "rejects.jsonl").read_bytes().splitlines()
    got = [orjson.loads(line) for line in lines]  # orjson refuses NaN and lone surrogates
    assert got[3]["id"] == "\\ud800" and [r["index"] for r in got] == [1, 2, 3, 4, 5]


def test_a_reject_line_writes_any_id_as_strict_json():
    import orjson

    from graphrun.write.journal import reject_line

    for rid, shown in ((float("nan"), "NaN"), (float("inf"), "Infinity"), ("a\ud800", "a\\ud800"),
                       ({"k": [float("-inf")]}, {"k": ["-Infinity"]}), ("r1", "r1"), (7, 7)):
        line = reject_line(3, rid, "d.jsonl:4", "why")
        assert orjson.loads(line) == {"index": 3, "id": shown, "where": "d.jsonl:4",
                                      "reason": "why"}


def test_jsonl_output_shards_are_strict_json_where_the_model_gives_nan_or_infinity(
        write_spec, tmp_path):
    """A record whose outputs are not finite (a NaN input, no finite: check): its line holds
    "NaN" as rejects.jsonl writes it, so orjson, jq and JavaScript read every line."""
    orjson = pytest.importorskip("orjson")
    rows = "".join(f'{{"x": [{i}, 1, 2, 3]}}\n' for i in range(3))
    from graphrun import run
    from tests.conftest import MLP_SPEC

    spec = write_spec(MLP_SPEC.replace("  dir: out\n", "  dir: out\n  format: jsonl\n"),
                      data='{"x": [NaN, 1, 2, 3]}\n' + rows)
    run(load_spec(spec))
    lines = (tmp_path / "out" / "part-00000.jsonl").read_bytes().splitlines()
    got = [orjson.loads(line) for line in lines]
    assert got[0]["scores"] == ["NaN"] * 3
    assert all(isinstance(v, float) for row in got[1:] for v in row["scores"])


@pytest.mark.parametrize("fmt, stray", [("jsonl", "part-00015.jsonl"),
                                        ("npy", "part-00015.ids.npy")])
def test_resume_of_a_completed_folder_names_a_stray_shard(tmp_path, fmt, stray):
    from graphrun.base.errors import OutputError

    spec = make_job(tmp_path, fmt=fmt)
    run_job(spec, tmp_path / "out")
    run_job(spec, tmp_path / "out", resume=True)  # a complete folder: nothing to do
    (tmp_path / "out" / stray).write_text('{"id": 999, "y": [0]}\n')
    with pytest.raises(OutputError, match=f"also holds {stray}, named as its shards but not"):
        run_job(spec, tmp_path / "out", resume=True)
