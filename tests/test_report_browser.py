"""The report in a real browser (Chromium driven by Playwright): no console error, no request
leaving the file, every chart drawn; a screenshot is saved.

Skipped where Chromium or Playwright is absent (.ci/run installs both). To refresh the
screenshot in docs/experiments.md: GRAPHRUN_SCREENSHOT=docs/report.png pytest tests/test_report_browser.py
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import graphrun
from graphrun.experiments.report import write_report

pytest.importorskip("plotly", reason="graphrun report needs plotly (the [report] extra)")
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="needs Playwright: pip install playwright")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None,
                                reason="needs Chromium: apt-get install -y chromium")


def open_report(page_html: Path, screenshot: Path) -> tuple[list[str], list[str], dict]:
    """Console errors, requests that left file://, and per chart: svg size and trace count."""
    errors, requests, charts = [], [], {}
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: None if r.url.startswith("file:")
                    else requests.append(r.url))
            page.goto(page_html.resolve().as_uri())
            n = page.locator("div[data-chart]").count()
            page.wait_for_function(
                f"document.querySelectorAll('div[data-chart] .js-plotly-plot').length == {n}",
                timeout=30_000)
            for el in page.query_selector_all("div[data-chart]"):
                svg = el.query_selector("svg.main-svg")
                box = svg.bounding_box() if svg else None
                charts[el.get_attribute("data-chart")] = (
                    box, len(el.query_selector_all("g.trace")),
                    len(el.query_selector_all("g.trace path, g.trace .point")))
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    return errors, requests, charts


def test_report_renders_every_chart_without_errors(write_spec, tmp_path):
    spec = write_spec()
    runs = [tmp_path / "a", tmp_path / "b"]
    graphrun.run(graphrun.load_spec(spec), out=runs[0])
    graphrun.run(graphrun.load_spec(spec, ["buckets.batch=[4]"]), out=runs[1])
    html = write_report(runs, tmp_path / "report.html")
    shot = Path(os.environ.get("GRAPHRUN_SCREENSHOT") or tmp_path / "report.png")
    errors, requests, charts = open_report(html, shot)
    assert errors == [] and requests == []
    assert set(charts) == {"latency", "batches", "capture", "phases", "timeline"}
    for name, (box, traces, marks) in charts.items():
        assert box and box["width"] > 300 and box["height"] > 200, name
        assert traces >= 2 and marks > 0, (name, traces, marks)
    assert shot.stat().st_size > 10_000


def test_sweep_report_renders_in_the_browser(tmp_path):
    from tests.test_report import write_sweep

    html = write_report([write_sweep(tmp_path / "sw")], tmp_path / "sweep.html")
    errors, requests, charts = open_report(html, tmp_path / "sweep.png")
    assert errors == [] and requests == []
    assert set(charts) == {"pareto", "throughput", "variant-latency"}
    for name, (box, traces, marks) in charts.items():
        assert box and box["width"] > 300 and traces >= 2 and marks > 0, name
