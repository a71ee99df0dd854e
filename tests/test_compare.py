"""graphrun compare: spec difference, per-bucket ratios, totals, outputs by sha256 or values."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main
from graphrun.experiments.compare import compare, spec_diff


def run_into(spec_path, out, *overrides):
    graphrun.run(graphrun.load_spec(spec_path, list(overrides)), out=out)
    return out


def test_spec_diff_gives_key_paths_and_missing_keys():
    a = {"capture": {"warmup_iters": 3, "pool": "shared"}, "buckets": {"batch": [1, 2]}}
    b = {"capture": {"warmup_iters": 5, "pool": "shared"}, "buckets": {"batch": [1, 2]},
         "extra": 1}
    assert spec_diff(a, b) == [("capture.warmup_iters", 3, 5), ("extra", None, 1)]


def test_same_spec_twice_is_identical_by_sha256(write_spec, tmp_path):
    spec = write_spec()
    a = run_into(spec, tmp_path / "a")
    b = run_into(spec, tmp_path / "b")
    result = compare(a, b)
    assert result["spec_diff"] == []
    assert result["outputs"]["equal"] and result["outputs"]["how"] == "sha256"
    assert {r["bucket"] for r in result["buckets"]} == {"batch=4", "batch=2"}  # 10 = 4+4+2
    ratio = next(r for r in result["totals"] if r["total"] == "records_out")["ratio"]
    assert ratio == 1.0


def test_other_format_compares_values_and_finds_a_changed_value(write_spec, tmp_path):
    spec = write_spec()
    a = run_into(spec, tmp_path / "a")
    b = run_into(spec, tmp_path / "b", "output.format=jsonl", "capture.warmup_iters=2")
    result = compare(a, b)
    assert [d["key"] for d in result["spec_diff"]] == ["capture.warmup_iters", "output.format"]
    out = result["outputs"]
    assert out["how"] == "values" and out["equal"] and out["common"] == 10
    assert out["max_abs_diff"] == {"scores": 0.0}
    # change one value of one record in B: found, with the size of the change
    shard = b / "part-00000.jsonl"
    lines = shard.read_text().splitlines()
    rec = json.loads(lines[3])
    rec["scores"][1] += 0.5
    lines[3] = json.dumps(rec)
    shard.write_text("\n".join(lines[:-1]) + "\n")  # and B loses its last record
    out = compare(a, b)["outputs"]
    assert not out["equal"] and out["within_tolerance"] is False
    assert abs(out["max_abs_diff"]["scores"] - 0.5) < 1e-6
    assert out["common"] == 9 and out["only_a"] == 1


def test_cli_prints_the_tables_and_a_missing_run_is_one_message(write_spec, tmp_path):
    spec = write_spec()
    a = run_into(spec, tmp_path / "a")
    b = run_into(spec, tmp_path / "b", "buckets.batch=[4]")
    result = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert result.exit_code == 0, result.output
    assert "buckets.batch" in result.output and "B/A" in result.output
    assert "outputs: " in result.output
    result = CliRunner().invoke(main, ["compare", str(a), str(tmp_path / "nope")])
    assert result.exit_code == 2 and "no manifest.json" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(main, ["compare", str(a), str(b), "--json"])
    assert json.loads(result.output)["spec_diff"][0]["key"] == "buckets.batch"


def test_two_bench_folders_compare_per_bucket_and_mode(write_spec, tmp_path):
    from graphrun.experiments.bench import bench

    spec = graphrun.load_spec(write_spec())
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(
            bench(spec, iters=2, warmup=0, log=lambda m: None).model_dump_json())
    result = compare(tmp_path / "a", tmp_path / "b")
    assert [(r["bucket"], r["mode"]) for r in result["buckets"]] == [
        ("batch=1", "eager"), ("batch=2", "eager"), ("batch=4", "eager")]
    r = result["buckets"][0]
    assert r["p50_ratio"] == r["b_p50_us"] / r["a_p50_us"]
    out = CliRunner().invoke(main, ["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert out.exit_code == 0 and "bench step latency" in out.output


def test_a_buckets_verification_reads_every_lane_and_older_manifests():
    from graphrun.experiments.compare import bucket_verified

    ok, bad = {"passed": True}, {"passed": False}
    assert bucket_verified({"lanes": [{"verify": ok}, {"verify": ok}]}) is True
    assert bucket_verified({"lanes": [{"verify": ok}, {"verify": bad}]}) is False
    assert bucket_verified({"lanes": [{"verify": None}]}) is None  # capture.verify off
    assert bucket_verified({"lanes": []}) is None  # skipped
    assert bucket_verified({"lanes": 1, "verify": bad}) is False  # lanes was a count before


def test_picked_ids_are_judged_by_the_records_that_differ(write_spec, tmp_path):
    """An argmax output: ids of near-tied scores may swap between two runs; a few records
    (capture.verify.picked_rows) are within tolerance, many are not."""
    from tests.conftest import MLP_SPEC

    spec = write_spec(MLP_SPEC.replace("scores: {shape: [batch, 3]}",
                                       "best: {shape: [batch], reduce: [argmax]}"),
                      data="".join(f'{{"x": [{i}, 1, 2, 3]}}\n' for i in range(40)))
    a = run_into(spec, tmp_path / "a")
    b = run_into(spec, tmp_path / "b", "output.format=jsonl")  # values compared, not sha256
    shard = b / "part-00000.jsonl"
    original = shard.read_text()

    def change(records: int) -> dict:
        lines = [json.loads(line) for line in original.splitlines()]
        for rec in lines[:records]:
            rec["best"] = (rec["best"] + 1) % 3
        shard.write_text("".join(json.dumps(r) + "\n" for r in lines))
        return compare(a, b)["outputs"]

    out = change(2)  # floor(0.05 * 40) = 2 records may pick other ids
    assert out["within_tolerance"] and out["picks_differ"] == {"best": 2}
    out = change(3)
    assert out["within_tolerance"] is False and out["picks_differ"] == {"best": 3}


def test_identical_runs_say_only_timing_differs_and_judge_it_on_the_batches(write_spec,
                                                                           tmp_path):
    spec = write_spec(data="".join(f'{{"x": [{i}, 1, 2, 3]}}\n' for i in range(40)))
    a = run_into(spec, tmp_path / "a", "buckets.batch=[4]")
    b = run_into(spec, tmp_path / "b", "buckets.batch=[4]")
    result = compare(a, b)
    assert result["only_timing_differs"] is True
    assert result["verdict"].startswith("outputs identical: only timing differs")
    assert result["timing"]["a_batches"] == result["timing"]["b_batches"] == 10
    # B given A's own batch times in another order: the same distribution, so no difference
    # beyond the noise, overall and in the bucket (real timings of two runs could differ)
    lines = (a / "latencies.jsonl").read_text().splitlines(keepends=True)
    (b / "latencies.jsonl").write_text("".join(reversed(lines)))
    result = compare(a, b)
    assert result["timing"]["significant"] is False
    assert "no significant difference" in result["timing"]["text"]
    assert [r["significant"] for r in result["buckets"]] == [False]
    out = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert "outputs identical: only timing differs. Timing over all batches" in out.output
    assert "beyond" in out.output and "noise" in out.output  # the header, on two lines
    # every batch of B slower than A's slowest: beyond the noise, said with its caveat
    slow = [json.loads(x) for x in lines]
    worst = max(json.loads(x)["e2e_us"] for x in lines)
    (b / "latencies.jsonl").write_text("".join(
        json.dumps({**r, "e2e_us": r["e2e_us"] + 2 * worst}) + "\n" for r in slow))
    result = compare(a, b)
    assert result["timing"]["significant"] is True and result["buckets"][0]["significant"]
    assert result["timing"]["text"].startswith("B is slower beyond the batches' noise")
    assert "one run a side" in result["timing"]["text"]


def test_too_few_batches_are_never_a_significant_difference():
    from graphrun.experiments.stats import batch_noise

    noise = batch_noise([100.0, 101.0], [900.0, 901.0])
    assert noise.significant is False and "too few batches" in noise.text
    assert noise.ratio == pytest.approx(900.5 / 100.5)
    assert batch_noise([], [1.0]).significant is False


def test_identical_bench_folders_report_no_significant_difference(write_spec, tmp_path):
    from graphrun.experiments.bench import bench

    text = bench(graphrun.load_spec(write_spec()), iters=2, warmup=0, repeats=3,
                 log=lambda m: None).model_dump_json()
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(text)
    result = compare(tmp_path / "a", tmp_path / "b")
    assert not any(r["significant"] for r in result["buckets"])
    assert result["timing"] == ("timing: no significant difference in any bucket (within the "
                                "noise)")


def generation_run(folder, tokens_per_s: float, p50_us: float):
    """A run folder holding only what compare reads: a generation run's manifest whose bucket
    names differ only at their end."""
    folder.mkdir()
    buckets = [{"name": f"batch=16,prompt={p},new=128", "batches": 2,
                "latency_us": {"e2e": {"p50": p50_us, "p99": p50_us * 1.1}}}
               for p in (128, 256)]
    manifest = {"spec": {"outputs": {}}, "buckets": buckets, "files": [],
                "totals": {"records_in": 64, "records_out": 64, "records_rejected": 0,
                           "batches": 4},
                "generation": {"output_tokens": 8192, "output_tokens_per_s": tokens_per_s}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_the_table_shows_whole_bucket_names_readable_latencies_and_tokens_per_s(tmp_path):
    import io

    from rich.console import Console

    from graphrun.experiments.compare import print_compare

    result = compare(generation_run(tmp_path / "a", 140.5, 3_645_356.0),
                     generation_run(tmp_path / "b", 79.7, 8_400.0))
    totals = {r["total"]: (r["a"], r["b"]) for r in result["totals"]}
    assert totals["output_tokens_per_s"] == (140.5, 79.7)
    assert totals["output_tokens"] == (8192, 8192)
    console = Console(width=120, file=io.StringIO())
    print_compare(result, console)
    text = console.file.getvalue()
    assert "batch=16,prompt=128,new=128" in text and "batch=16,prompt=256,new=128" in text
    assert "3.65 s" in text and "4.01 s" in text and "8,400 us" in text
    assert "3,645,356" not in text and "…" not in text
    assert "output_tokens_per_s" in text and "79.7" in text


def test_a_resumed_run_is_said_so_beside_its_totals(write_spec, tmp_path):
    """A resumed run's records_out is its whole output, its other totals its last attempt's:
    compare says so, in the terminal and in the report."""
    from graphrun.experiments.report import compare_html

    spec = write_spec()
    a = run_into(spec, tmp_path / "a")
    b = run_into(spec, tmp_path / "b")
    assert compare(a, b)["notes"] == []
    m = json.loads((b / "manifest.json").read_text())
    m["resumed_from"], m["totals"]["earlier_records_out"] = 6, 6
    (b / "manifest.json").write_text(json.dumps(m))
    note = ("B was resumed (--resume) at record 6: its records_out is its whole output, its "
            "other totals are its last attempt's (4 of its 10 records out)")
    assert compare(a, b)["notes"] == [note]
    out = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert note in " ".join(out.output.split())
    assert "B was resumed (--resume) at record 6" in compare_html([a, b], ["A", "B"])


def test_a_run_that_failed_is_said_so_and_no_shared_record_is_no_pass(write_spec, tmp_path):
    """B failed before committing a record: compare says B did not complete, and its outputs
    are "not compared" rather than "within tolerance over 0 records"."""
    spec = write_spec()
    a = run_into(spec, tmp_path / "a")
    b = run_into(spec, tmp_path / "b")
    m = json.loads((b / "manifest.json").read_text())
    m["status"], m["error"] = "failed", "the model failed on its first call\n  check the spec"
    m["files"], m["totals"]["records_out"] = [], 0
    for f in b.glob("part-*"):
        f.unlink()
    (b / "manifest.json").write_text(json.dumps(m))
    result = compare(a, b)
    assert result["notes"][0] == ("B's run did not complete (status failed: the model failed "
                                  "on its first call): its outputs are the 0 records it "
                                  "committed")
    out = " ".join(CliRunner().invoke(main, ["compare", str(a), str(b)]).output.split())
    assert "outputs: not compared, no record is in both runs (10 only in A, 0 only in B)" in out
    assert "within A's verify tolerance" not in out and not result["only_timing_differs"]
