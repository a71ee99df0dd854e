"""graphrun report: one self-contained page of charts; run --report writes it."""

from __future__ import annotations

import re
import sys

import pytest
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main

pytest.importorskip("plotly", reason="graphrun report needs plotly (the [report] extra)")

CHARTS = ["latency", "batches", "capture", "phases", "timeline"]


def test_report_of_two_runs_is_self_contained_with_every_chart(write_spec, tmp_path):
    spec = write_spec()
    a, b = tmp_path / "a", tmp_path / "b"
    graphrun.run(graphrun.load_spec(spec), out=a)
    graphrun.run(graphrun.load_spec(spec, ["buckets.batch=[4]"]), out=b)
    out = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", str(a), str(b), "-o", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert re.findall(r'data-chart="(\w+)"', page) == CHARTS
    assert not re.search(r"<script[^>]+src=", page) and "<link" not in page  # nothing fetched
    assert page.count("Plotly.newPlot") == len(CHARTS)
    assert '"name":"a e2e p50"' in page and '"name":"b e2e p50"' in page


def test_run_with_report_writes_it_beside_the_manifest(write_spec, tmp_path):
    spec = write_spec()
    result = CliRunner().invoke(main, ["run", str(spec), "--out", str(tmp_path / "o"),
                                       "--report"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "o" / "report.html").stat().st_size > 100_000  # plotly.js inlined


def test_a_folder_without_a_manifest_is_one_message(tmp_path):
    result = CliRunner().invoke(main, ["report", str(tmp_path), "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 2 and "no manifest.json" in result.output
    assert "Traceback" not in result.output


def test_missing_plotly_says_which_extra(write_spec, tmp_path, monkeypatch):
    spec = write_spec()
    graphrun.run(graphrun.load_spec(spec), out=tmp_path / "a")
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    result = CliRunner().invoke(main, ["report", str(tmp_path / "a")])
    assert result.exit_code == 2 and "pip install 'graphrun[report]'" in result.output


def write_sweep(folder):
    from graphrun.experiments.sweep import Sweep, Variant, mark_pareto

    rows = [Variant(name=f"v0{i}_b-{b}", overrides={"data.batch_size": b}, status="completed",
                    records_per_s=rate, p50_us=10.0 * b, p99_us=20.0 * b, capture_s=0.1,
                    memory_bytes=mem, padding_waste=0.1, verify="passed")
            for i, (b, rate, mem) in enumerate([(2, 100.0, 1 << 20), (4, 180.0, 3 << 20),
                                                (8, 150.0, 5 << 20)])]
    rows.append(Variant(name="v03_b-16", overrides={"data.batch_size": 16}, status="failed",
                        error="boom"))
    mark_pareto(rows)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep.json").write_text(
        Sweep(spec="p.yaml", grid={"data.batch_size": [2, 4, 8, 16]}, variants=rows)
        .model_dump_json())
    return folder


def test_report_of_a_sweep_draws_the_front(tmp_path):
    out = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", str(write_sweep(tmp_path / "sw")), "-o",
                                       str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert re.findall(r'data-chart="([\w-]+)"', page) == ["pareto", "throughput",
                                                          "variant-latency"]
    # the front: v00 (least memory) and v01 (fastest); v02 is dominated by v01
    front = re.search(r'"name":"Pareto front".*?"text":\[([^\]]*)\]', page).group(1)
    assert front == '"v00_b-2","v01_b-4"'
    assert "failed: boom" in page


def test_report_of_a_bench_folder(write_spec, tmp_path):
    from graphrun.experiments.bench import bench

    result = bench(graphrun.load_spec(write_spec()), iters=2, warmup=0, log=lambda m: None)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench.json").write_text(result.model_dump_json())
    out = tmp_path / "r.html"
    assert CliRunner().invoke(main, ["report", str(tmp_path / "b"), "-o", str(out)]).exit_code == 0
    assert re.findall(r'data-chart="([\w-]+)"', out.read_text()) == [
        "bench-latency", "bench-speedup", "bench-capture"]
