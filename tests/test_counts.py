"""The manifest's counts and warnings say what happened (issue 20): after --resume, with no
rejects, with nothing but rejects; and timing warnings only where a timing means something."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main


def spec_dict(**data) -> dict:
    return {
        "version": 1, "name": "counts", "device": "cpu",
        "model": {"builtin": "mlp",
                  "args": {"in_features": 4, "hidden": 8, "layers": 2, "out_features": 3}},
        "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32"}},
        "outputs": {"scores": {"shape": ["batch", 3]}},
        "buckets": {"batch": [1, 2, 4, 8, 16]},
        "capture": {"warmup_iters": 1},
        "data": {"path": "data.jsonl", "id_field": "id", "batch_size": 16,
                 "on_bad_record": "skip", **data},
        "output": {"dir": "out", "format": "npy", "rows_per_file": 50},
    }


def make_job(folder: Path, n: int, bad=lambda i: i % 37 == 5, spec: dict | None = None) -> Path:
    with open(folder / "data.jsonl", "w") as f:
        for i in range(n):
            x = [i / n, 1, 2] if bad(i) else [i / n, 1, 2, 3]  # bad: 3 values for 4
            f.write(json.dumps({"id": i, "x": x}) + "\n")
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec or spec_dict(), sort_keys=False))
    return path


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_after_resume_totals_are_the_whole_run_and_the_rest_this_attempt(tmp_path):
    spec = graphrun.load_spec(make_job(tmp_path, 400))
    out = tmp_path / "out"
    clean = graphrun.run(spec, out=out, overlap=False)
    # as if killed -9 right after the first shard's commit: only its journal line is kept
    journal = out / "journal.jsonl"
    first = json.loads(journal.read_text().splitlines()[0])
    journal.write_text(journal.read_text().splitlines(keepends=True)[0])
    m = graphrun.run(spec, out=out, resume=True, overlap=False)
    t = m.totals
    assert m.status == "completed" and m.resumed_from == first["next_index"]
    assert (t.records_in, t.records_out, t.records_rejected) == (
        clean.totals.records_in, clean.totals.records_out, clean.totals.records_rejected)
    assert t.records_in == t.records_out + t.records_rejected == 400
    assert t.earlier_records_out == 50 and t.earlier_records_rejected == first["rejects"]
    # batches and buckets: what this attempt ran, which starts at the batch holding the
    # first record not committed (up to one batch again)
    attempt_out = t.records_out - t.earlier_records_out
    ran = sum(b.records for b in m.buckets)
    assert 0 <= ran - attempt_out < 16 and t.batches == sum(b.batches for b in m.buckets)
    assert t.batches < clean.totals.batches
    assert t.records_per_s == pytest.approx(attempt_out / t.stream_s)


def test_resume_of_a_completed_run_says_already_complete(tmp_path):
    spec = make_job(tmp_path, 100)
    assert cli("run", spec, "-q").exit_code == 0
    before = (tmp_path / "out" / "manifest.json").read_bytes()
    result = cli("run", spec, "--resume")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("already complete: 97 records out, 3 rejected")
    assert (tmp_path / "out" / "manifest.json").read_bytes() == before


def test_no_rejects_no_rejects_path(tmp_path):
    spec = graphrun.load_spec(make_job(tmp_path, 40, bad=lambda i: False))
    m = graphrun.run(spec)
    assert m.rejects == {"path": None, "count": 0}
    assert not (tmp_path / "out" / "rejects.jsonl").exists()
    spec = graphrun.load_spec(make_job(tmp_path, 40))
    m = graphrun.run(spec, out=tmp_path / "out2")
    assert m.rejects == {"path": "rejects.jsonl", "count": 1}
    assert len((tmp_path / "out2" / "rejects.jsonl").read_text().splitlines()) == 1


def test_a_run_whose_every_record_was_rejected_warns_and_exits_1(tmp_path):
    spec = make_job(tmp_path, 10, bad=lambda i: True)
    result = cli("run", spec)
    assert result.exit_code == 1
    assert "every record (10) was rejected" in result.output
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["totals"]["records_out"] == 0
    assert any(w.startswith("every record (10) was rejected (the first, data.jsonl:1: ")
               for w in m["warnings"]), m["warnings"]


def test_resume_of_a_run_whose_every_record_was_rejected_exits_1_too(tmp_path):
    """--resume of it said "already complete" and exited 0: a script retrying with --resume
    took the run that wrote nothing for a success."""
    spec = make_job(tmp_path, 10, bad=lambda i: True)
    assert cli("run", spec).exit_code == 1
    before = (tmp_path / "out" / "manifest.json").read_bytes()
    result = cli("run", spec, "--resume")
    assert result.exit_code == 1, result.output
    assert result.output.startswith("already complete: 0 records out, 10 rejected")
    assert "every record (10) was rejected; see " in result.output
    assert (tmp_path / "out" / "manifest.json").read_bytes() == before


def test_timings_are_called_noisy_only_where_they_matter_and_are_long_enough(tmp_path):
    """On the CPU the copies are host memcpys of microseconds: a p99 of 160x their median is
    the scheduler, not a finding. A replay of 2 ms with such a tail is worth a warning."""
    from graphrun.feed.loop import feed_stream
    from graphrun.job.parts import JobParts

    count = [0]

    def noisy(ran):  # each batch's measured phases, replaced as the stream hands them on
        for _, out in ran:
            count[0] += 1
            tail = count[0] % 25 == 0  # 4% of batches: the p99 lands in the tail
            if "h2d" in out:
                out["h2d"] = 2400.0 if tail else 15.0
                out["replay"] = 20000.0 if tail else 2000.0
        return ran

    def stream(*args, on_batches, **kwargs):
        return feed_stream(*args, on_batches=lambda ran, *a: on_batches(noisy(ran), *a),
                           **kwargs)

    raw = spec_dict()
    raw["buckets"]["batch"] = [4]
    raw["data"]["batch_size"] = 4
    m = graphrun.run(graphrun.load_spec(make_job(tmp_path, 400, bad=lambda i: False,
                                                 spec=raw)), overlap=False,
                     parts=JobParts(feed_stream=stream))
    noisy_phases = [w.split(":")[0] for w in m.warnings if "timings are noisy" in w]
    assert "bucket batch=4 replay" in noisy_phases
    assert not any("h2d" in w or "d2h" in w for w in noisy_phases), m.warnings


def test_the_noise_floor_per_phase_and_clock():
    from graphrun.manifest.latency import noise_floor_us, spread_warning

    fast = [15.0] * 98 + [2400.0] * 2
    assert noise_floor_us("h2d", cuda=False) is None
    assert spread_warning(fast, "h2d", noise_floor_us("h2d", cuda=True)) is None  # 15 < 20 us
    slow = [500.0] * 98 + [5000.0] * 2
    assert spread_warning(slow, "replay", noise_floor_us("replay", cuda=True))
    assert spread_warning(slow, "replay", noise_floor_us("replay", cuda=False)) is None


def test_the_manifest_says_which_path_ran_and_why(tmp_path, monkeypatch):
    raw = spec_dict()
    raw["buckets"]["batch"] = [4]
    raw["data"]["batch_size"] = 4
    spec = graphrun.load_spec(make_job(tmp_path, 24, bad=lambda i: False, spec=raw))
    monkeypatch.setenv("GRAPHRUN_OVERLAP", "auto")  # the CPU's default: serial
    t = graphrun.run(spec, out=tmp_path / "auto").totals
    assert (t.overlapped, t.overlap_reason) == (False, "serial: the default on the CPU")
    monkeypatch.setenv("GRAPHRUN_OVERLAP", "on")
    t = graphrun.run(spec, out=tmp_path / "on").totals
    assert (t.overlapped, t.overlap_reason) == (True, "overlapped: set by GRAPHRUN_OVERLAP")
    t = graphrun.run(spec, out=tmp_path / "off", overlap=False).totals
    assert (t.overlapped, t.overlap_reason) == (False, "serial: set by run()'s overlap")
    # a manifest from before the CPU's overlap trial was removed still reads back
    from graphrun.manifest.keys import Manifest
    old = json.loads((tmp_path / "off" / "manifest.json").read_text())
    old["totals"]["overlap_trials"] = [{"serial": 1.0, "overlapped": 2.0}]
    assert Manifest.model_validate(old).totals.overlapped is False


def test_the_shipped_decoder_step_demo_skips_its_bad_records(tmp_path):
    root = Path(__file__).resolve().parent.parent
    spec = graphrun.load_spec(root / "pipelines" / "decoder-step.yaml", ["device=cpu"])
    m = graphrun.run(spec, out=tmp_path / "o", overlap=False)
    assert m.status == "completed" and m.totals.records_in == 2000
    assert (m.totals.records_out, m.totals.records_rejected) == (1996, 4)
    rejects = [json.loads(x) for x in (tmp_path / "o" / "rejects.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rejects] == ["req-000350", "req-000850", "req-001350", "req-001850"]
    assert all(r["reason"] for r in rejects)


def test_a_run_of_an_empty_input_completes_and_warns_that_nothing_was_read(tmp_path):
    spec = make_job(tmp_path, 0, bad=lambda i: False)
    result = cli("run", spec)
    assert result.exit_code == 0, result.output
    assert "warning: the input held no records" in result.output
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["status"] == "completed" and m["totals"]["records_in"] == 0
    spec = make_job(tmp_path, 3, bad=lambda i: False)
    assert "held no records" not in cli("run", spec, "--overwrite").output
    # a slice past the file's records: the slice was empty, not the file
    said = " ".join(cli("run", spec, "--overwrite", "--start", 500).output.split())
    assert "warning: --start 500 selected no record of" in said and "(it holds 500 or fewer)" in \
        said and "held no records" not in said


def test_a_resumed_runs_last_line_says_what_came_before_it(tmp_path):
    spec = make_job(tmp_path, 400)
    assert cli("run", spec, "-q").exit_code == 0
    clean = json.loads((tmp_path / "out" / "manifest.json").read_text())["totals"]
    journal = tmp_path / "out" / "journal.jsonl"
    first = json.loads(journal.read_text().splitlines()[0])
    journal.write_text(journal.read_text().splitlines(keepends=True)[0])  # killed after it
    (tmp_path / "out" / "manifest.json").unlink()
    result = cli("run", spec, "--resume")
    assert result.exit_code == 0, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"completed: {clean['records_out']} records out, "
                           f"{clean['records_rejected']} rejected (50 out and "
                           f"{first['rejects']} rejected before this --resume), "), last
