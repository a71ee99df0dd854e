"""graphrun report: one self-contained page of charts; run --report writes it. The page says
what ran, shows padding per axis, rejects and warnings, and leaves out charts with no data."""

from __future__ import annotations

import html
import json
import random
import re
import sys

import pytest
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main
from graphrun.experiments import charts
from graphrun.experiments.report import render

pytest.importorskip("plotly", reason="graphrun report needs plotly (the [report] extra)")

EAGER = "eager on the CPU: nothing was captured"


def chart_names(page: str) -> list[str]:
    return re.findall(r'data-chart="([\w-]+)"', page)


def banner(page: str) -> list[str]:
    """The lines of the what-ran list, which comes straight after the title."""
    m = re.search(r"</h1><ul class=\"what-ran\" id=\"what-ran\">(.*?)</ul>", page)
    assert m, "the page does not start with what ran"
    return [html.unescape(t) for t in re.findall(r"<li[^>]*>(.*?)</li>", m.group(1))]


def write_tokens(tmp_path, n: int = 40, bad: tuple = (), seed: int = 0):
    """A spec of token records of random lengths 1..60 (seq buckets 8..64) and its data; the
    lines in `bad` hold a token out of range (rejected: on_bad_record skip)."""
    from tests.test_group_by_length import write_job

    path = write_job(tmp_path, n=n, bad=bad, seed=seed)
    path.write_text(path.read_text().replace("batch_size: 8", "batch_size: 4"))
    return path


def test_report_of_two_runs_is_self_contained_and_says_what_ran(write_spec, tmp_path):
    spec = write_spec()
    a, b = tmp_path / "a", tmp_path / "b"
    graphrun.run(graphrun.load_spec(spec), out=a)
    graphrun.run(graphrun.load_spec(spec, ["buckets.batch=[4]"]), out=b)  # 10 rows: 2 padded
    out = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", str(a), str(b), "-o", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    # eager on the CPU: no graph memory chart; every other chart holds data
    # and no set-up chart: on the CPU a bucket gets neither a warm-up nor a capture
    assert chart_names(page) == ["latency", "batches", "padding", "phases", "timeline"]
    assert "memory (no graph memory: nothing captured)" in page
    assert "setup (no warm-up or capture ran" in page
    assert not re.search(r"<script[^>]+src=", page) and "<link" not in page  # nothing fetched
    assert page.count("Plotly.newPlot") == 5
    assert '"name":"a e2e p50"' in page and '"name":"b e2e p50"' in page
    assert banner(page) == [f"a: {EAGER}", f"b: {EAGER}"]
    assert "capture s" not in page  # no capture trace where nothing was captured
    # padded rows are bars per bucket (categories), not a line joining them
    chart = page.split('data-chart="padding"')[1].split("data-chart")[0]
    assert '"name":"b padded rows"' in chart and '"type":"bar"' in chart
    assert '"mode":"lines' not in chart


@pytest.fixture(scope="module")
def token_run(tmp_path_factory):
    """A run of 40 token records of lengths 1..60, 7 of them rejected: (folder, manifest)."""
    tmp = tmp_path_factory.mktemp("tokens")
    spec = write_tokens(tmp, n=40, bad=(3, 11, 12, 20, 30, 31, 35))
    return tmp / "o", graphrun.run(graphrun.load_spec(spec), out=tmp / "o")


def test_a_run_page_shows_padded_positions_per_axis_rejects_and_warnings(token_run):
    folder, manifest = token_run
    assert manifest.totals.records_rejected == 7
    page = render([folder])
    assert banner(page) == [EAGER]
    seq = manifest.totals.padding_ratio_positions["seq"]
    assert f"seq {100 * seq:.1f}%" in page  # the summary's padded positions
    assert re.search(r'"name":"o padded seq positions"', page)
    # the first 5 rejects with their input lines and reasons, and where the rest are
    assert "7 rejected records (the first 5; rejects.jsonl has them all)" in page
    for line in (4, 12, 13, 21, 31):
        assert f"data.jsonl:{line}<" in page
    assert "data.jsonl:32" not in page
    reason = json.loads((folder / "rejects.jsonl").read_text().splitlines()[0])["reason"]
    assert html.escape(reason) in page


def test_per_bucket_padding_adds_up_to_the_totals(token_run):
    from graphrun.experiments.report import bucket_padding

    m = json.loads(token_run[1].model_dump_json())
    ran = [b for b in m["buckets"] if b["batches"]]
    assert len(ran) > 1
    rows = sum(b["records"] + b["padded_rows"] for b in ran)
    slots = sum((b["records"] + b["padded_rows"]) * b["sizes"]["seq"] for b in ran)
    padded = sum(bucket_padding(b)["seq positions"] / 100 * (b["records"] + b["padded_rows"])
                 * b["sizes"]["seq"] for b in ran)
    assert padded / slots == pytest.approx(m["totals"]["padding_ratio_positions"]["seq"])
    assert sum(bucket_padding(b)["rows"] / 100 * (b["records"] + b["padded_rows"])
               for b in ran) / rows == pytest.approx(m["totals"]["padding_ratio"])


def test_a_captured_run_names_the_gpu_and_draws_capture_and_memory(write_spec, tmp_path):
    """A manifest as a GPU run writes it (statuses, capture times, pool growth), from a CPU one."""
    graphrun.run(graphrun.load_spec(write_spec()), out=tmp_path / "g")
    path = tmp_path / "g" / "manifest.json"
    m = json.loads(path.read_text())
    m["environment"].update(device="cuda:0", gpu="NVIDIA H200", backend="cuda-graph")
    for i, b in enumerate(m["buckets"]):
        b.update(status="captured", capture_s=0.01 * (i + 1), memory_bytes=(i + 1) << 20)
    m["buckets"][0].update(status="eager", reason="capture failed: boom")
    path.write_text(json.dumps(m))
    page = render([tmp_path / "g"])
    assert banner(page) == [("CUDA graphs on NVIDIA H200 (cuda:0): 2 buckets captured, "
                                    "1 eager (capture failed: boom)")]
    assert {"setup", "memory"} <= set(chart_names(page))
    assert '"name":"g capture s"' in page and "capture and warm-up seconds" in page


@pytest.mark.slow
def test_a_generation_run_has_its_own_part(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_generate_job import write_spec as write_generation

    spec = write_generation(tmp_path, n=4, generate={"max_new_tokens": 3},
                            buckets={"batch": [4], "seq": [128, 512]})
    manifest = graphrun.run(graphrun.load_spec(spec))
    page = render([tmp_path / "out"])
    assert banner(page) == [EAGER]
    part = page.split('<section id="generation">')[1].split("</section>")[0]
    g = manifest.generation
    assert f"{g.output_tokens_per_s:,.1f}" in part and f"{g.output_tokens:,}" in part
    assert "TTFT ms (p50/p90/p99)" in part and "TPOT ms (p50/p90/p99)" in part
    reasons = ", ".join(f"{k} {v:,}" for k, v in g.finish_reasons.items())
    assert reasons in part
    assert "decode steps waiting on the host" in part  # a count on a GPU, "-" here
    assert "slot occupancy" in part and f"{100 * g.slot_occupancy:.1f}%" in part
    assert f"{g.prompt_tokens_computed:,} / {g.prompt_tokens_reused:,} (" in part
    # 4 prompts: their TTFT and TPOT p90 and p99 would be the largest; the median is in the table
    assert not {"generation-ttft", "generation-tpot"} & set(chart_names(page))
    assert "generation-graphs" not in chart_names(page)  # eager graphs: no set-up times


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


def test_a_bench_folder_beside_a_run_folder_is_said_to_be_reported_alone(tmp_path):
    """It said "no manifest.json: not a run folder" of the bench folder."""
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench.json").write_text("{}")
    (tmp_path / "r").mkdir()
    result = CliRunner().invoke(main, ["report", str(tmp_path / "r"), str(tmp_path / "b"),
                                       "-o", str(tmp_path / "x.html")])
    assert result.exit_code == 2, result.output
    assert (f"{tmp_path / 'b'}: a bench folder is reported on its own: `graphrun report "
            f"{tmp_path / 'b'}`; run folders are compared together") in result.output
    assert "Traceback" not in result.output


FOREIGN = [
    ("manifest.json", '[1]', "manifest.json: not a graphrun manifest (no spec, totals, "
                             "buckets, files of the right type): give the folder `graphrun run`"),
    ("manifest.json", '{"x": 1}', "manifest.json: not a graphrun manifest"),
    ("manifest.json", '{"spec": {}, "totals": {"records_in": 3}, "buckets": [], "files": []}',
     "manifest.json: a damaged manifest: totals lacks records_out, records_rejected: run the "
     "job again into this folder (--overwrite)"),
    ("bench.json", '{"x": 1}', "bench.json: not a bench.json graphrun wrote (8 problem(s); the "
                               "first: x: Extra inputs are not permitted): give the folder "
                               "`graphrun bench` wrote"),
    ("bench.json", '', "bench.json: not a bench.json graphrun wrote (1 problem(s); the first: "
                       "Invalid JSON"),
    ("sweep.json", '{"x": 1}', "sweep.json: not a sweep.json graphrun wrote"),
]


@pytest.mark.parametrize("verb, name, text, says", [
    (verb, *case) for verb in ("report", "compare") for case in FOREIGN
    if verb == "report" or case[0] != "sweep.json"])  # compare reads run and bench folders
def test_a_foreign_or_broken_json_file_is_one_message(tmp_path, verb, name, text, says):
    """Such a file was a KeyError, an AttributeError or pydantic's ValidationError, with a
    traceback, out of report and compare."""
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        (tmp_path / side / name).write_text(text)
    args = ([str(tmp_path / "a"), "-o", str(tmp_path / "r.html")] if verb == "report" else
            [str(tmp_path / "a"), str(tmp_path / "b")])
    result = CliRunner().invoke(main, [verb, *args])
    assert result.exit_code == 2 and f"error: {tmp_path / 'a' / name}: " in result.output
    assert says in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "r.html").exists()


def test_report_writes_no_file_through_a_link_and_names_a_file_in_a_folders_place(
        write_spec, tmp_path):
    """-o onto a link wrote through it (run --report too, into the output folder, which
    graphrun writes through no link); a file where -o's folder belongs was mkdir's
    FileExistsError traceback."""
    spec = write_spec()
    assert CliRunner().invoke(main, ["run", str(spec), "--out", str(tmp_path / "o")]
                              ).exit_code == 0
    (tmp_path / "elsewhere").write_text("keep")
    (tmp_path / "r.html").symlink_to(tmp_path / "elsewhere")
    result = CliRunner().invoke(main, ["report", str(tmp_path / "o"), "-o",
                                       str(tmp_path / "r.html")])
    assert result.exit_code == 2 and "r.html is a link" in result.output, result.output
    assert (tmp_path / "elsewhere").read_text() == "keep"
    result = CliRunner().invoke(main, ["report", str(tmp_path / "o"), "-o",
                                       str(tmp_path / "elsewhere" / "x" / "r.html")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (f"cannot write {tmp_path / 'elsewhere' / 'x' / 'r.html'}: "
            f"{tmp_path / 'elsewhere'} is a file, not a folder") in result.output


def test_a_run_folder_killed_before_its_manifest_says_to_resume_it(tmp_path):
    (tmp_path / "run.json").write_text("{}")  # what a run killed mid-stream leaves, less shards
    (tmp_path / "journal.jsonl").write_text("")
    result = CliRunner().invoke(main, ["report", str(tmp_path), "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 2 and "--resume" in result.output
    assert "not a run folder" not in result.output


def test_missing_plotly_says_which_extra(write_spec, tmp_path, monkeypatch):
    spec = write_spec()
    graphrun.run(graphrun.load_spec(spec), out=tmp_path / "a")
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    result = CliRunner().invoke(main, ["report", str(tmp_path / "a")])
    assert result.exit_code == 2 and 'pip install -e ".[report]"' in result.output


def write_sweep(folder, memory: bool = True):
    """A sweep's sweep.json: three completed variants (graph memory 1, 3, 5 MiB, or none as on
    the CPU) and a failed one; with memory off each variant folder holds a CPU manifest."""
    from graphrun.experiments.sweep import Sweep, Variant, mark_pareto

    rows = [Variant(name=f"v0{i}_b-{b}", overrides={"data.batch_size": b}, status="completed",
                    records_per_s=rate, p50_us=10.0 * b, p99_us=20.0 * b, capture_s=0.1,
                    memory_bytes=mem if memory else None, padding_waste=0.1 * (i + 1),
                    verify="passed")
            for i, (b, rate, mem) in enumerate([(2, 100.0, 1 << 20), (4, 180.0, 3 << 20),
                                                (8, 150.0, 5 << 20)])]
    rows.append(Variant(name="v03_b-16", overrides={"data.batch_size": 16}, status="failed",
                        error="boom"))
    mark_pareto(rows)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep.json").write_text(
        Sweep(spec="p.yaml", grid={"data.batch_size": [2, 4, 8, 16]}, variants=rows)
        .model_dump_json())
    if not memory:
        for v in rows[:3]:
            (folder / v.name).mkdir(exist_ok=True)
            (folder / v.name / "manifest.json").write_text(json.dumps(
                {"status": "completed", "environment": {"device": "cpu", "backend": "eager"},
                 "buckets": [{"name": "batch=4", "status": "eager", "batches": 1}]}))
    return folder


def test_report_of_a_sweep_draws_the_front(tmp_path):
    out = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", str(write_sweep(tmp_path / "sw")), "-o",
                                       str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert chart_names(page) == ["throughput", "pareto", "padding", "variant-latency"]
    # the front: v00 (least memory) and v01 (fastest); v02 is dominated by v01
    front = re.search(r'"name":"Pareto front".*?"text":\[([^\]]*)\]', page).group(1)
    assert front == '"v00_b-2","v01_b-4"'
    assert "failed: boom" in page


def test_a_cpu_sweep_leaves_out_the_scatter_and_says_eager(tmp_path):
    page = render([write_sweep(tmp_path / "sw", memory=False)])
    assert banner(page)[0].startswith("eager on the CPU: nothing was captured in any variant")
    assert chart_names(page) == ["throughput", "padding", "variant-latency"]
    assert "pareto (no variant took graph memory" in page
    assert r"v00\u003cbr\u003ebatch_size=2" in page  # ticks name the overrides, one per line


def test_report_of_a_cpu_bench_folder_has_its_table_and_only_latency(write_spec, tmp_path):
    from graphrun.experiments.bench import bench

    result = bench(graphrun.load_spec(write_spec()), iters=2, warmup=0, log=lambda m: None)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench.json").write_text(result.model_dump_json())
    out = tmp_path / "r.html"
    assert CliRunner().invoke(main, ["report", str(tmp_path / "b"), "-o", str(out)]).exit_code == 0
    page = out.read_text()
    assert banner(page) == [EAGER]
    assert chart_names(page) == ["bench-latency"]  # speedup all 1 and empty capture left out
    assert "bench-speedup (eager alone ran" in page
    table = page.split('<table class="bench">')[1].split("</table>")[0]
    assert table.count("<tr>") == 1 + len(result.buckets)
    assert "batch=4" in table and "FAILED" not in table  # eager on the CPU: verify is off


def test_a_bench_with_graphs_draws_speedup_capture_and_memory(write_spec, tmp_path):
    from graphrun.experiments.bench import bench

    result = bench(graphrun.load_spec(write_spec()), iters=2, warmup=0, log=lambda m: None)
    for b in result.buckets:  # a graph mode beside eager, as a GPU bench writes it
        eager = b.modes[0]
        b.modes.append(eager.model_copy(update={
            "mode": "graph", "backend": "cuda-graph", "speedup": 3.0, "capture_s": 0.02,
            "memory_bytes": 2 << 20}))
    result.device = "cuda:0"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench.json").write_text(result.model_dump_json())
    page = render([tmp_path / "b"])
    assert banner(page) == ["CUDA graphs on cuda:0: 3 buckets captured"]
    assert chart_names(page) == ["bench-latency", "bench-speedup", "bench-capture",
                                 "bench-memory"]


@pytest.mark.parametrize("integer", [False, True])
def test_tick_steps_are_round(integer):
    rng = random.Random(0)
    for _ in range(500):
        span = 10 ** rng.uniform(-4, 7)
        step = charts.nice_step(span, integer=integer)
        mantissa = step / 10 ** int(f"{step:e}".split("e")[1])
        assert round(mantissa, 9) in (1.0, 2.0, 2.5, 5.0), (span, step)
        assert span / step <= 6.0 + 1e-9
        if integer:
            assert step >= 1 and step == int(step)
    assert charts.count_axis("batches", [1])["dtick"] == 1  # one batch: no 0.2 steps


def test_a_run_that_failed_before_its_device_says_so(write_spec, tmp_path):
    graphrun.run(graphrun.load_spec(write_spec()), out=tmp_path / "f")
    path = tmp_path / "f" / "manifest.json"
    m = json.loads(path.read_text())
    m.update(status="failed", error="model: no such file", environment=None)
    path.write_text(json.dumps(m))
    assert banner(render([tmp_path / "f"])) == [
        "failed (model: no such file); no device was set up: no batch ran"]


def test_two_runs_get_compare_s_verdict_and_equal_percentiles_are_drawn_once(write_spec,
                                                                             tmp_path):
    spec = write_spec()  # 10 records in batches of 4, 4, 2: one or two batches a bucket
    a, b = tmp_path / "a", tmp_path / "b"
    graphrun.run(graphrun.load_spec(spec), out=a)
    graphrun.run(graphrun.load_spec(spec, ["output.format=jsonl"]), out=b)
    page = render([a, b])
    part = page.split('<section class="compare">')[1].split("</section>")[0]
    text = html.unescape(part)
    assert "Timing over all batches" in text  # compare's verdict
    assert "output.format" in text and '"npy"' in text and '"jsonl"' in text
    assert "outputs: equal over 10 records both hold" in text
    # one or two batches a bucket: p90 and p99 are the largest batch, not drawn
    page = render([a])
    assert 'class="compare"' not in page
    assert re.findall(r'"name":"a e2e (p\d+)"', page) == ["p50"]
    assert "p90 only of a bucket of 10+ batches, p99 only of a bucket of 100+ batches" in page
