"""graphrun sweep: every combination of the grid runs in its own process; a failing variant is
a row; sweep.json validates against schemas/sweep.schema.json; the Pareto front is marked."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from click.testing import CliRunner

from graphrun.cli.main import main
from graphrun.experiments.sweep import SCHEMA, Variant, mark_pareto, parse_grid, schema_text, variants


def sweep(spec, out, *args) -> tuple:
    """`graphrun sweep SPEC ARGS --out OUT`, which must succeed: (its result, sweep.json, which
    must validate against the schema)."""
    result = CliRunner().invoke(main, ["sweep", str(spec), *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "sweep.json").read_text())
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    return result, doc


def test_the_checked_in_schema_is_current():
    assert SCHEMA.read_text() == schema_text(), (
        "stale: python3 -c 'from graphrun.experiments.sweep import *; SCHEMA.write_text(schema_text())'")


def test_grid_parses_yaml_lists_and_rejects_anything_else():
    grid = parse_grid(("capture.warmup_iters=[1, 3]", "buckets.batch=[[1,2],[4]]"))
    assert grid == {"capture.warmup_iters": [1, 3], "buckets.batch": [[1, 2], [4]]}
    assert [o for _, o in variants(grid)][1] == {"capture.warmup_iters": 1,
                                                 "buckets.batch": [4]}
    for bad in ("capture.warmup_iters=3", "x=[]", "=[1]", "k=[1"):
        with pytest.raises(Exception, match="--grid"):
            parse_grid((bad,))


def test_pareto_front_is_the_non_dominated_variants():
    def v(name, rate, mem):
        return Variant(name=name, overrides={}, status="completed", records_per_s=rate,
                       memory_bytes=mem)

    rows = [v("a", 100, 10), v("b", 200, 30), v("c", 150, 40), v("d", 50, 5),
            Variant(name="e", overrides={}, status="failed", error="x")]
    mark_pareto(rows)
    assert [r.name for r in rows if r.pareto] == ["a", "b", "d"]


@pytest.mark.slow
def test_sweep_runs_each_variant_and_keeps_going_after_failures(write_spec, tmp_path):
    spec = write_spec()
    (tmp_path / "bad.jsonl").write_text('{"x": [1, 2, 3, 4]}\n{"x": [1, 2]}\n')
    out = tmp_path / "sw"
    # batch_size 8 > the largest batch bucket (4) with oversize: error is an invalid variant;
    # a record of the wrong shape fails in the variant's own run (a child process)
    result, doc = sweep(spec, out, "--grid", "data.batch_size=[2,4,8]", "--grid",
                        "data.path=[data.jsonl, bad.jsonl]", "--set", "data.oversize=error",
                        "--stop", "6")
    rows = doc["variants"]
    assert [r["status"] for r in rows] == ["completed", "failed"] * 2 + ["failed"] * 2
    assert "bad.jsonl:2" in rows[1]["error"] and "must be 4" in rows[1]["error"]
    assert "larger than the largest batch bucket" in rows[4]["error"]
    for r in (rows[0], rows[2]):
        manifest = json.loads((out / r["name"] / "manifest.json").read_text())
        assert manifest["totals"]["records_out"] == 6  # --stop 6
        assert manifest["spec"]["data"]["batch_size"] == r["overrides"]["data.batch_size"]
        # every bucket's capture and memory, not only those 6 records select (capture.lazy)
        assert [b["set_up"] for b in manifest["buckets"]] == ["setup"] * 3
        # the CPU captures nothing, so nothing is verified
        assert r["verify"] == ("passed" if torch.cuda.is_available() else "off")
        assert r["records_per_s"] > 0
    assert rows[0]["outputs_equal_first"] is None and rows[2]["outputs_equal_first"] is True
    # batches of 2 into buckets [1, 2, 4] pad nothing; 6 records as 4 + 2 pad nothing either
    assert rows[0]["padding_waste"] == 0 and rows[2]["padding_waste"] == 0
    assert any(r["pareto"] for r in rows) and not any(r["pareto"] for r in rows[4:])
    assert result.output.count("failed") >= 4 and "records/s" in result.output


def test_a_generation_sweep_shows_output_tokens_per_s_and_tells_completions_apart(tmp_path):
    from tests.test_generate_job import write_spec as write_generation_spec

    spec = write_generation_spec(tmp_path, n=4, data__group_by_length=None,
                                 buckets={"batch": [1, 2], "seq": [8, 16]},
                                 generate={"max_new_tokens": 2, "min_new_tokens": 2,
                                           "sampling": {"method": "greedy"}})
    out = tmp_path / "sw"
    result, doc = sweep(spec, out, "--grid", "generate.max_new_tokens=[2,3]", "--grid",
                        "data.batch_size=[1,2]", "--set", "generate.min_new_tokens=0",
                        "--repeats", "1")
    rows = doc["variants"]
    assert [r["status"] for r in rows] == ["completed"] * 4, result.output
    for r in rows:
        gen = json.loads((out / r["name"] / "manifest.json").read_text())["generation"]
        assert r["output_tokens_per_s"] == gen["output_tokens_per_s"] > 0
        assert r["padding_waste"] == gen["prefill_padding"]  # as run, the prompts packed
    # the same completions at another batch size; longer ones are not the first's
    assert [r["outputs_equal_first"] for r in rows] == [None, True, False, False]
    assert "tokens/s" in result.output and "output tokens/s" in result.output
    # one repeat: no winner is named on its tokens/s, the default objective of a generation spec
    assert doc["objective"] == "tokens_per_s" and doc["recommendation"]["variant"] is None
    assert "no significant difference in output tokens/s" in result.output


def _row(name, rates, *, mib=0, p99_ms=None, **overrides):
    from graphrun.experiments.stats import spread

    p99 = spread([p99_ms * 1e3] * len(rates)) if p99_ms is not None else None
    rate = spread(rates)
    return Variant(name=name, overrides=overrides, status="completed", repeats=len(rates),
                   records_per_s=rate.median, records_per_s_spread=rate,
                   memory_bytes=int(mib * 2**20), p99_us=p99 and p99.median, p99_us_spread=p99)


def test_a_variant_breaking_a_constraint_is_marked_and_never_recommended():
    from graphrun.experiments.sweep import Constraints, check_constraints, recommend

    base = {"data": {"batch_size": 8}, "capture": {"pool": "shared"}}
    rows = [_row("v00", [100, 101, 102], mib=10, p99_ms=5, **{"data.batch_size": 8}),
            _row("v01", [300, 305, 310], mib=500, p99_ms=5, **{"data.batch_size": 32}),
            _row("v02", [200, 201, 202], mib=20, p99_ms=9, **{"data.batch_size": 16}),
            Variant(name="v03", overrides={"data.batch_size": 64}, status="failed",
                    error="out of memory")]
    check_constraints(rows, Constraints(max_memory_mib=100, max_p99_ms=8))
    assert rows[1].broken == ["graph memory 500.0 MiB > --max-memory-mib 100"]
    assert rows[2].broken == ["p99 9.00 ms (median of its repeats) > --max-p99-ms 8"]
    rec = recommend(rows, "records_per_s", base)
    # the fastest two break a constraint: the one left is recommended, the spec as it is
    assert rec.variant == "v00" and rows[0].pick == "recommended"
    assert rec.options[0].changes == [] and rec.options[0].set_args == []
    assert not any(r.pick for r in rows[1:])
    why = " ".join(rec.why)
    assert "v01 is left out: graph memory" in why and "v03 is left out: it failed" in why
    # without the memory limit, v01 wins beyond the noise: its one spec line to change
    for r in rows:
        r.broken, r.pick = [], None
    check_constraints(rows, Constraints(max_p99_ms=8))
    rec = recommend(rows, "records_per_s", base)
    assert rec.variant == "v01" and "wins beyond the noise" in rec.why[0]
    assert [(c.key, c.base, c.value) for c in rec.options[0].changes] == [
        ("data.batch_size", 8, 32)]
    assert rec.options[0].set_args == ["data.batch_size=32"]
    # p99 as the objective (lower is better), nothing beyond the noise: both shown
    rows = [_row("a", [1, 2, 3], p99_ms=5.0), _row("b", [1, 2, 3], p99_ms=5.1)]
    rows[0].p99_us_spread = rows[0].p99_us_spread.model_copy(update={"min": 4000.0})
    rec = recommend(rows, "p99_ms", base)
    assert rec.variant is None and rec.within_noise == ["a", "b"]
    assert [r.pick for r in rows] == ["within_noise"] * 2
    assert "no significant difference in p99 latency ms" in rec.why[0]


def test_the_recommendation_comes_first_on_the_page_then_the_table(tmp_path):
    from graphrun.experiments.sweep import Sweep, recommend
    from graphrun.experiments.sweep_report import recommendation_lines, sweep_html

    rows = [_row("v00", [100, 130, 115], **{"data.batch_size": 8}),
            _row("v01", [110, 140, 120], **{"data.batch_size": 16})]
    rec = recommend(rows, "records_per_s", {"data": {"batch_size": 8}})
    result = Sweep(spec="p.yaml", grid={"data.batch_size": [8, 16]}, repeats=3,
                   variants=rows, recommendation=rec)
    lines = recommendation_lines(result)
    assert lines[0] == ("no significant difference in records/s between v01, v00: no winner "
                        "named")
    assert "v01: --set data.batch_size=16  (data.batch_size: 8 -> 16)" in lines[1]
    assert "v00: the spec as it is" in lines[2]
    (tmp_path / "sweep.json").write_text(result.model_dump_json())
    page = sweep_html(tmp_path)
    assert page.index('class="recommendation"') < page.index("<table>")
    assert 'data-significant="no"' in page and "115.0" in page and "100.0..130.0" in page
    assert page.count("within noise") == 2


def test_tokens_per_s_is_an_objective_only_for_a_generation_spec(write_spec, tmp_path):
    result = CliRunner().invoke(main, ["sweep", str(write_spec()), "--grid",
                                       "data.batch_size=[2,4]", "--objective", "tokens_per_s",
                                       "--out", str(tmp_path / "sw")])
    assert result.exit_code == 2 and "--objective tokens_per_s: only a generation spec" in \
        result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_a_repeated_sweep_names_a_winner_only_where_its_own_ranges_separate(write_spec,
                                                                            tmp_path):
    """The same sweep twice, variants of the same speed, repeats round-robin: a winner is
    named only where its measured range is separated from every other variant's by the rule
    (so on a busy machine a sweep may name one, but never against its own numbers); where none
    is named, the table says so and shows every variant within the noise."""
    from graphrun.experiments.stats import Spread, separated

    spec = write_spec(data="".join(f'{{"x": [{i}, 1, 2, 3]}}\n' for i in range(24)))
    recs, outputs = [], []
    for k in (1, 2):
        out = tmp_path / f"sw{k}"
        result, doc = sweep(spec, out, "--grid", "capture.warmup_iters=[1,2]", "--repeats", "3")
        assert doc["repeats"] == 3
        for v in doc["variants"]:
            assert v["repeats"] == 3 and v["records_per_s_spread"]["n"] == 3
            assert v["folders"][0] == v["name"] and len(set(v["folders"])) == 3
            s = v["records_per_s_spread"]
            assert s["min"] <= v["records_per_s"] == s["median"] <= s["max"]
        # round-robin: every variant's repeat k starts before any variant's repeat k + 1
        starts = {(v["name"], i): json.loads((out / f / "manifest.json").read_text())[
            "started_at"] for v in doc["variants"] for i, f in enumerate(v["folders"])}
        order = sorted(starts, key=starts.get)
        assert [i for _, i in order] == [0, 0, 1, 1, 2, 2]
        recs.append(doc["recommendation"])
        outputs.append(result.output)
    for doc_rec, k in zip(recs, (1, 2)):
        doc = json.loads((tmp_path / f"sw{k}" / "sweep.json").read_text())
        spreads = {v["name"]: Spread(**v["records_per_s_spread"]) for v in doc["variants"]}
        best = max(spreads, key=lambda n: spreads[n].median)
        apart = all(separated(spreads[best], spreads[n], True) for n in spreads if n != best)
        assert doc_rec["variant"] == (best if apart else None), (doc_rec, spreads)
    for rec, output in zip(recs, outputs):
        if rec["variant"] is None:  # the table and the answer say it, and show both
            assert rec["within_noise"] and "no significant difference" in rec["why"][0]
            assert "no significant difference in records/s" in output
            assert output.count("within noise") == len(rec["within_noise"])
            assert sorted(o["variant"] for o in rec["options"]) == sorted(rec["within_noise"])
    for a, b in ((recs[0], recs[1]), (recs[1], recs[0])):
        if a["variant"] is not None and b["variant"] is None:
            assert a["variant"] in b["within_noise"]  # the other sweep: within its noise


def test_the_objective_s_chart_draws_each_variant_s_range_and_the_verdict(tmp_path):
    pytest.importorskip("plotly")
    from graphrun.experiments.charts import plotly
    from graphrun.experiments.sweep import Sweep, recommend
    from graphrun.experiments.sweep_report import sweep_figures

    rows = [_row("v00", [100, 180, 140], **{"data.batch_size": 8}),
            _row("v01", [60, 100, 80], **{"data.batch_size": 16})]
    rec = recommend(rows, "records_per_s", {"data": {"batch_size": 8}})
    (tmp_path / "sweep.json").write_text(Sweep(
        spec="p.yaml", grid={"data.batch_size": [8, 16]}, repeats=3, variants=rows,
        recommendation=rec).model_dump_json())
    figures = dict(f for f in sweep_figures(plotly(), tmp_path) if isinstance(f, tuple))
    bar = figures["throughput"].data[0]
    assert list(bar.y) == [140, 80]
    assert list(bar.error_y.array) == [40, 20] and list(bar.error_y.arrayminus) == [40, 20]
    title = figures["throughput"].layout.title.text
    assert "no significant difference in records/s between v00, v01" in title
    assert "no significant difference" not in figures["variant-latency"].layout.title.text
