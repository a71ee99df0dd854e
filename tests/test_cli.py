"""The command line: exit codes, one clear message per user error, no traceback."""

from __future__ import annotations

import datetime
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrun.cli.main import main
from tests.conftest import MLP_SPEC
from tests.children import child_env

ROOT = Path(__file__).resolve().parent.parent


def cli(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def test_validate_every_shipped_pipeline_ok():
    pipelines = sorted((ROOT / "pipelines").glob("*.yaml"))
    result = cli("validate", *pipelines)
    assert result.exit_code == 0, result.output
    assert result.output.count(": ok") == len(pipelines) >= 3


def test_every_shipped_pipeline_points_editors_at_the_schema():
    for path in (ROOT / "pipelines").glob("*.yaml"):
        first = path.read_text().splitlines()[0]
        assert first == "# yaml-language-server: $schema=../schemas/pipeline.schema.json", path


def test_validate_reports_each_file_and_fails_if_any_fails(write_spec):
    good = write_spec()
    bad = write_spec(MLP_SPEC.replace("warmup_iters: 1", "warmup_iters: -1"), name="bad.yaml")
    result = cli("validate", good, bad)
    assert result.exit_code == 1
    assert f"{good}: ok" in result.output
    assert f"{bad}: invalid" in result.output
    assert f"{bad}:14:17: capture.warmup_iters: must be >= 0 (got -1)" in result.output
    assert "Traceback" not in result.output


def test_run_with_a_bad_spec_exits_2_with_one_message_and_no_traceback(write_spec):
    bad = write_spec(MLP_SPEC.replace("builtin: mlp", "builtin: nope"))
    result = cli("run", bad)
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {bad}:5:12: model.builtin: unknown builtin 'nope'")
    assert "Traceback" not in result.output


def test_debug_shows_the_traceback(write_spec):
    bad = write_spec(MLP_SPEC.replace("builtin: mlp", "builtin: nope"))
    proc = subprocess.run([sys.executable, "-m", "graphrun", "--debug", "run", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_run_writes_outputs_and_manifest_and_set_overrides_apply(write_spec, tmp_path):
    spec = write_spec()
    result = cli("run", spec, "--set", "output.format=jsonl", "--set", "buckets.batch=[1,8]",
                 "-q")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "completed"
    assert manifest["totals"]["records_out"] == 10
    assert manifest["spec"]["output"]["format"] == "jsonl"
    assert [b["name"] for b in manifest["buckets"]] == ["batch=8", "batch=1"]
    lines = (tmp_path / "out" / "part-00000.jsonl").read_text().splitlines()
    assert [json.loads(l)["id"] for l in lines] == list(range(10))


def test_a_stop_before_the_start_is_one_message_and_writes_nothing(write_spec, tmp_path):
    spec = write_spec()
    for extra in ([], ["--gpus", "2", "--set", "device=cpu"]):
        result = cli("run", spec, "--start", 8, "--stop", 3, "-q", *extra)
        assert result.exit_code == 2, result.output
        assert "--stop 3 is before --start 8" in result.output
        assert "Traceback" not in result.output and not (tmp_path / "out").exists()
    import graphrun
    from graphrun.base.errors import InputError
    try:
        graphrun.run(graphrun.load_spec(spec), start=8, stop=3)
    except InputError as err:
        assert "stop=3 is before start=8" in str(err)
    else:
        raise AssertionError("the Python API ran a slice that ends before it starts")
    assert not (tmp_path / "out").exists()


def test_rerun_into_the_same_folder_is_refused_then_overwrite_works(write_spec, tmp_path):
    spec = write_spec()
    assert cli("run", spec, "-q").exit_code == 0
    again = cli("run", spec, "-q")
    assert again.exit_code == 2 and "--overwrite" in again.output
    assert cli("run", spec, "-q", "--overwrite").exit_code == 0
    assert "pick one" in cli("run", spec, "--resume", "--overwrite").output


def test_schema_check_passes_on_the_checked_in_schemas_and_spec_page():
    result = cli("schema", "--check")
    assert result.exit_code == 0, result.output


def test_schema_check_fails_on_a_stale_schema(tmp_path):
    (tmp_path / "pipeline.schema.json").write_text("{}\n")
    result = cli("schema", "pipeline", "--check", "--out", tmp_path)
    assert result.exit_code == 1 and "stale" in result.output
    # the command that rewrites them: `graphrun schema` alone writes the checkout's, or fails
    assert (f"; run `graphrun schema pipeline --out {tmp_path}`" in result.output
            and "and commit" not in result.output), result.output
    assert cli("schema", "pipeline", "--out", tmp_path).exit_code == 0
    assert cli("schema", "pipeline", "--check", "--out", tmp_path).exit_code == 0


def tree_state(folder: Path) -> dict:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in folder.rglob("*") if p.is_file() and ".git" not in p.parts}


def test_schema_outside_a_checkout_writes_nothing_and_says_how(tmp_path):
    """Run as a user would, from their own (empty) folder, by the repository's graphrun."""
    before = tree_state(ROOT)
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "graphrun", "schema"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "not inside a graphrun source checkout" in proc.stderr and "--out ." in proc.stderr
    assert list(tmp_path.iterdir()) == []
    printed = subprocess.run([sys.executable, "-m", "graphrun", "schema", "--stdout"],
                             cwd=tmp_path, env=env, capture_output=True, text=True)
    assert json.loads(printed.stdout)["title"] == "graphrun pipeline spec, version 1"
    assert list(tmp_path.iterdir()) == []
    wrote = subprocess.run([sys.executable, "-m", "graphrun", "schema", "--out", "."],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert wrote.returncode == 0, wrote.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.schema.json",
                                                          "pipeline.schema.json"]
    assert tree_state(ROOT) == before


def test_schema_in_a_checkout_rewrites_that_checkout_only(tmp_path, monkeypatch):
    from graphrun.manifest import schema

    (tmp_path / "graphrun" / "spec").mkdir(parents=True)
    (tmp_path / "graphrun" / "spec" / "keys.py").write_text("")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "graphrun"\n')
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "spec.md"
    page.write_text(f"top\n{schema.REF_START}\nOLD TABLE\n{schema.REF_END}\n")
    (tmp_path / "README.md").write_text("readme\n")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    refused = cli("schema")  # the checkout is not the graphrun running
    assert refused.exit_code == 2 and "is not the checkout's" in refused.output
    # a patch: `graphrun schema` checks the checkout against the running package's folder
    monkeypatch.setattr(schema, "PACKAGE_DIR", tmp_path / "graphrun")
    assert cli("schema").exit_code == 0
    assert json.loads((tmp_path / "schemas" / "pipeline.schema.json").read_text())["title"]
    assert "`capture.verify.rtol`" in page.read_text()
    assert page.read_text().startswith("top\n") and "OLD TABLE" not in page.read_text()
    assert (tmp_path / "README.md").read_text() == "readme\n"
    assert cli("schema", "--check").output.strip() == "schemas are current"
    page.write_text(page.read_text().replace("`capture.verify.rtol`", "`gone`"))
    stale = cli("schema", "--check")
    assert stale.exit_code == 1 and "spec.md" in stale.output


def test_report_help_names_every_folder_it_draws():
    """report draws bench folders too (README, experiments.md), which its help left out."""
    said = " ".join(cli("report", "--help").output.split())
    assert "run folders (compared), a sweep folder or a bench folder" in said, said


def test_debug_is_accepted_after_the_verb(write_spec):
    bad = write_spec(MLP_SPEC.replace("builtin: mlp", "builtin: nope"))
    proc = subprocess.run([sys.executable, "-m", "graphrun", "run", str(bad), "--debug"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" in proc.stderr
    plain = cli("validate", bad)  # and it does not stick to the next invocation
    assert "Traceback" not in plain.output


def test_a_run_outside_a_terminal_prints_progress_lines_summary_and_warnings(
        write_spec, monkeypatch):
    from graphrun.job import progress
    from graphrun.job import state

    # patches: the CLI builds its own run and progress, reached only through the command
    monkeypatch.setattr(progress, "LINE_S", 0.0)  # a line every batch
    monkeypatch.setattr(state, "spread_warning",
                        lambda values, what, *_, **__: f"{what}: spread too wide to trust")
    result = cli("run", write_spec())  # CliRunner's stdout is no terminal
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d"  # each line's ISO time
    assert any(re.match(stamp + r" graphrun: 4/10 records \(40%\), ", l) for l in lines), \
        result.output
    assert any(re.fullmatch(stamp + r" graphrun: 10/10 records \(100%\), [\d,]+ records/s, "
                            r"ETA 0:00:00", l) for l in lines), result.output
    # the summary's lines are whole, not cut at 80 columns, when piped
    assert any(l.startswith("records in 10, out 10, rejected 0; ") and "padding" in l
               for l in lines), result.output
    # capture.lazy left batch=1 unused (batches of 4, 4 and 2): one row for the unused
    assert any(re.match(r"1 bucket not used\s+unused", l) for l in lines), result.output
    assert not any(l.startswith("batch=1 ") for l in lines), result.output
    assert "warning: bucket batch=4 e2e: spread too wide to trust" in result.output


def test_progress_lines_give_rate_and_eta():
    from graphrun.job.progress import ProgressLines

    out = io.StringIO()
    lines = ProgressLines(total=1000, out=out)
    lines.done = 250
    stamp, text = lines.line(10.0).split(" ", 1)
    assert datetime.datetime.fromisoformat(stamp).tzinfo is not None  # local time, with offset
    assert text == "graphrun: 250/1,000 records (25%), 25 records/s, ETA 0:00:30"
    assert ProgressLines(None, out).line(1.0).split(" ", 1)[1] == \
        "graphrun: 0 records, 0 records/s"


def test_spec_page_lists_every_key():
    from graphrun.manifest.schema import SPEC_PAGE, spec_reference

    page = (ROOT / SPEC_PAGE).read_text()
    assert spec_reference() in page
    for key in ("capture.verify.rtol", "data.on_bad_record", "inputs.<name>.range"):
        assert f"`{key}`" in page


def test_summary_table_fits_80_columns_names_the_buckets_used_and_counts_the_rest(
        write_spec, tmp_path, capsys, monkeypatch):
    import graphrun
    from graphrun.job.progress import summary_table

    monkeypatch.setenv("COLUMNS", "80")
    manifest = graphrun.run(graphrun.load_spec(write_spec()), out=tmp_path / "o")
    capsys.readouterr()
    summary_table(manifest)
    text = capsys.readouterr().out
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("bucket"))
    assert lines[header].split() == ["bucket", "status", "batches", "records", "padded",
                                     "replay", "capture", "verify"]
    table = lines[header:header + 4]
    assert max(map(len, table)) <= 80
    for name in ("batch=4", "batch=2"):
        assert any(line.startswith(name + " ") for line in table), name
    assert any(line.startswith("1 bucket not used ") for line in table), table
    # piped, the summary's lines are whole: none is cut at 80 columns
    assert any(line.startswith("records in 10, out 10, rejected 0; ") and "padding" in line
               for line in lines), text
    # batches of 4, 4, 2: buckets 4 and 2 set up from the reader's first batches, 1 never
    assert "buckets: 2 set up at start, 1 never set up (no batch selected them: " \
        "capture.lazy)" in text
    assert re.search(r"stream \(serial\): read \d+%, pad \d+%, launch \d+%, device wait "
                     r"\d+%, write \d+%; busiest: \w+", text), text


def test_an_output_folder_that_cannot_be_made_is_one_clear_error(write_spec, tmp_path):
    (tmp_path / "a-file").write_text("")
    result = cli("run", write_spec(), "-q", "--out", tmp_path / "a-file" / "sub")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (f"output folder {tmp_path / 'a-file' / 'sub'} is inside {tmp_path / 'a-file'}, "
            "a file, not a folder") in " ".join(result.output.split())


def test_an_output_folder_that_is_a_file_is_named_so(write_spec, tmp_path):
    (tmp_path / "a-file").write_text("")
    result = cli("run", write_spec(), "-q", "--set", f"output.dir={tmp_path / 'a-file'}")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"output.dir: {tmp_path / 'a-file'} is a file, not a folder" in \
        " ".join(result.output.split())
    assert (tmp_path / "a-file").read_text() == ""  # left as it was


def test_a_full_disk_mid_run_is_an_output_error_and_the_manifest_says_failed(
        write_spec, tmp_path, monkeypatch):
    from graphrun.write import shards

    def no_space(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    # a patch: the CLI builds its own writer (no JobParts through the command)
    monkeypatch.setattr(shards.ShardWriter, "write", no_space)
    result = cli("run", write_spec(), "-q")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "No space left on device" in result.output and "--resume" in result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "No space left" in manifest["error"]


def test_the_progress_bar_counts_every_record_with_few_updates(monkeypatch):
    from graphrun.job.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    progress = Progress(True, total=1000, out=Terminal())
    bar, pushes = progress._bar, []
    advance = bar.advance
    # a patch: a spy on rich's bar (a library's object), which Progress makes
    monkeypatch.setattr(bar, "advance", lambda task, n: (pushes.append(n), advance(task, n)))
    for _ in range(100):  # a fast run: 100 batches well within one update interval
        progress.advance(10)
    progress.close()
    assert bar.tasks[0].completed == 1000 and sum(pushes) == 1000
    assert len(pushes) < 10


def test_every_verb_declares_debug_once():
    from graphrun.cli.main import main

    for name, command in main.commands.items():
        debug = [p for p in command.params if p.name == "debug"]
        assert len(debug) == 1, f"graphrun {name}: --debug declared {len(debug)} times"


def test_a_sigint_while_the_engine_imports_is_held_until_the_imports_end():
    """A SIGINT inside the spec's load or torch's import is raised once they are done, so no
    module is left half-imported; the CLI then exits 130 with its one line."""
    import signal

    from graphrun.cli.main import HeldInterrupt

    before = signal.getsignal(signal.SIGINT)
    reached = False
    with pytest.raises(KeyboardInterrupt):
        with HeldInterrupt():
            os.kill(os.getpid(), signal.SIGINT)
            reached = True  # the block runs to its end
    assert reached and signal.getsignal(signal.SIGINT) is before
    with HeldInterrupt():  # no signal: nothing raised
        pass
