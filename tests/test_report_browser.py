"""The report in a real browser (Chromium driven by Playwright), for a CPU run, a sweep and a
bench page: no console error, no request leaving the file, every chart drawn with data points,
round tick steps, what ran said at the top; a screenshot of each page is kept.

Screenshots go to $GRAPHRUN_TEST_ARTIFACTS (.ci/run sets artifacts/report, git-ignored), else
under pytest's tmp dir. Skipped where Chromium or Playwright is absent (.ci/run installs both).
To refresh the screenshot in docs/experiments.md:
GRAPHRUN_SCREENSHOT=docs/report.png pytest tests/test_report_browser.py -k run_page
"""

from __future__ import annotations

import math
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
pytestmark = [pytest.mark.skipif(CHROMIUM is None,
                                 reason="needs Chromium: apt-get install -y chromium"),
              pytest.mark.slow]  # a browser and three pages: about 20 s on 2 cores

# per chart: per trace its points and, per dimension on a linear axis, the values not 0; per
# axis its type and the tick values drawn; the marks drawn
INSPECT = """el => {
  const gd = el.querySelector('.js-plotly-plot');
  const box = el.querySelector('svg.main-svg').getBoundingClientRect();
  const axis = id => gd._fullLayout[id[0] + 'axis' + id.slice(1)];
  const traces = gd._fullData.map(t => {
    const nonzero = {};
    for (const d of ['x', 'y']) {
      if (axis(t[d + 'axis']).type !== 'linear') continue;
      const v = Array.from(t[d] || []);
      nonzero[d] = v.filter(x => x !== null && Number.isFinite(+x) && +x !== 0).length;
    }
    return {name: t.name, points: Array.from(t.y || t.x || []).length, nonzero};
  });
  const axes = Object.keys(gd._fullLayout).filter(k => /^[xy]axis\\d*$/.test(k)).map(k => {
    const a = gd._fullLayout[k];
    return {name: k, type: a.type, tickformat: a.tickformat,
            values: (a._vals || []).map(t => t.x), ticks: (a._vals || []).map(t => t.text)};
  });
  return {width: box.width, height: box.height, traces, axes,
          marks: el.querySelectorAll('g.trace path, g.trace .point').length};
}"""


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM,
                              args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    folder = os.environ.get("GRAPHRUN_TEST_ARTIFACTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        return Path(folder)
    return tmp_path_factory.mktemp("report-screenshots")


def open_report(browser, page_html: Path, screenshot: Path) -> dict:
    """The page's console errors, requests that left file://, the what-ran text and per chart
    what INSPECT returns; a full-page screenshot is saved."""
    errors, requests = [], []
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    try:
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: None if r.url.startswith("file:")
                else requests.append(r.url))
        page.goto(page_html.resolve().as_uri())
        n = page.locator("div[data-chart]").count()
        page.wait_for_function(
            f"document.querySelectorAll('div[data-chart] .js-plotly-plot .main-svg').length"
            f" >= {n}", timeout=30_000)
        charts = {el.get_attribute("data-chart"): el.evaluate(INSPECT)
                  for el in page.query_selector_all("div[data-chart]")}
        top = page.locator("#what-ran").inner_text() if page.locator("#what-ran").count() else ""
        page.screenshot(path=str(screenshot), full_page=True)
    finally:
        page.close()
    assert screenshot.stat().st_size > 10_000
    return {"errors": errors, "requests": requests, "charts": charts, "top": top}


def round_step(step: float) -> bool:
    mantissa = step / 10 ** math.floor(math.log10(step))
    return any(math.isclose(mantissa, m, rel_tol=1e-6) for m in (1, 2, 2.5, 5, 10))


def check_page(result: dict) -> dict:
    """Every chart drawn and sized; every trace with points and, on each linear axis, a value
    that is not 0 (one run per page: no trace is there for comparison alone); ticks of the
    linear axes a round step apart (1, 2, 2.5 or 5 times a power of ten), whole numbers on
    axes of counts."""
    assert result["errors"] == [] and result["requests"] == []
    assert result["charts"], "no chart on the page"
    for name, chart in result["charts"].items():
        assert chart["width"] > 300 and chart["height"] > 200, name
        assert chart["marks"] > 0, name
        for t in chart["traces"]:
            assert t["points"] > 0, (name, t)
            assert all(t["nonzero"].values()), (name, t, "every value is 0")
        for axis in chart["axes"]:
            if axis["type"] != "linear" or len(axis["values"]) < 2:
                continue
            steps = {round(b - a, 9) for a, b in zip(axis["values"], axis["values"][1:])}
            assert len(steps) == 1 and round_step(steps.pop()), (name, axis)
            if axis["tickformat"] == ",d":
                assert all(float(v).is_integer() for v in axis["values"]), (name, axis)
    return result["charts"]


def test_a_cpu_run_page_says_eager_and_draws_every_chart(browser, artifacts, tmp_path):
    from tests.test_report import write_tokens

    spec = write_tokens(tmp_path, n=40, bad=(3, 11))
    graphrun.run(graphrun.load_spec(spec), out=tmp_path / "run")
    html = write_report([tmp_path / "run"], tmp_path / "run.html")
    shot = Path(os.environ.get("GRAPHRUN_SCREENSHOT") or artifacts / "cpu-run.png")
    result = open_report(browser, html, shot)
    assert result["top"].strip() == "eager on the CPU: nothing was captured"
    charts = check_page(result)
    # no set-up chart: on the CPU a bucket gets neither a warm-up nor a capture
    assert set(charts) == {"latency", "batches", "padding", "phases", "timeline"}
    assert {t["name"] for t in charts["padding"]["traces"]} >= {"run padded seq positions"}


def test_a_sweep_page_renders_in_the_browser(browser, artifacts, tmp_path):
    from tests.test_report import write_sweep

    cpu = write_report([write_sweep(tmp_path / "cpu", memory=False)], tmp_path / "cpu.html")
    result = open_report(browser, cpu, artifacts / "sweep-cpu.png")
    assert result["top"].startswith("eager on the CPU")
    assert set(check_page(result)) == {"throughput", "padding", "variant-latency"}
    gpu = write_report([write_sweep(tmp_path / "gpu")], tmp_path / "gpu.html")
    charts = check_page(open_report(browser, gpu, artifacts / "sweep-graph-memory.png"))
    assert set(charts) == {"throughput", "pareto", "padding", "variant-latency"}


def test_a_bench_page_renders_in_the_browser(browser, artifacts, write_spec, tmp_path):
    from graphrun.experiments.bench import bench

    result = bench(graphrun.load_spec(write_spec()), iters=3, warmup=1, log=lambda m: None)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench.json").write_text(result.model_dump_json())
    page = open_report(browser, write_report([tmp_path / "b"], tmp_path / "bench.html"),
                       artifacts / "bench-cpu.png")
    assert page["top"].strip() == "eager on the CPU: nothing was captured"
    assert set(check_page(page)) == {"bench-latency"}
