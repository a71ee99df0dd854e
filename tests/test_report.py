"""graphrun report: one self-contained page of charts; run --report writes it."""

from __future__ import annotations

import re
import sys

import pytest
from click.testing import CliRunner

import graphrun
from graphrun.cli import main

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
