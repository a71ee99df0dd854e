"""`buckets: auto` in a generation spec: the run plans its batch and prompt lists with the
planner `graphrun plan` uses (plan/auto.py's plan_spec over plan/generation.py), prefill and
decode graphs counted against buckets_max_graphs, no prompt bucket past the model's positions
less generate.max_new_tokens."""

from __future__ import annotations

import importlib.util
import json

import pytest

import graphrun
from graphrun.plan.generation import GRAPHS, graphs_of
from tests.test_generate_job import NEW, completions, write_spec
from tests.test_init_generate import cli, short_model, yaml_lists

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or
    importlib.util.find_spec("tokenizers") is None,
    reason="needs transformers and tokenizers (the hf extra)")

AUTO = {"batch": "auto", "seq": "auto"}


def auto_spec(tmp_path, *, n: int = 40, new: int = NEW, positions: int | None = None, **changes):
    """A generation spec over n prompts with both axes auto; positions: the tiny Llama copied
    with that many."""
    if positions is not None:
        changes["model"] = {"hf": {"path": str(short_model(tmp_path, positions)),
                                   "class": "AutoModelForCausalLM"}, "dtype": "float32"}
    changes.setdefault("buckets", AUTO)
    return write_spec(tmp_path, n=n, generate={"max_new_tokens": new,
                                               "sampling": {"method": "greedy"}}, **changes)


def planned(spec, *sets) -> dict:
    """The lists `graphrun plan` prints for the spec."""
    result = cli("plan", spec, *(x for s in sets for x in ("--set", s)))
    assert result.exit_code == 0, result.output
    return yaml_lists(result.output)


def test_auto_runs_with_the_lists_plan_proposes_and_counts_every_graph(tmp_path):
    spec = auto_spec(tmp_path)
    lists = planned(spec)
    out = tmp_path / "o"
    # every graph set up at start, so the manifest lists each graph the lists make
    run = cli("run", spec, "--out", out, "--set", "capture.lazy=false",
              "--set", "capture.memory_budget_mib=4096")
    assert run.exit_code == 0, run.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["spec"]["buckets"] == lists
    bp = manifest["bucket_plan"]
    assert bp["buckets"] == lists and bp["auto_axes"] == ["batch", "seq"]
    counted = graphs_of(lists, NEW)
    assert counted.decode > 0
    assert (bp["graphs"], bp["decode_graphs"]) == (counted.total, counted.decode)
    assert bp["graphs"] == len(lists["batch"]) + len(lists["seq"])  # the decode graphs count
    assert bp["max_graphs"] == GRAPHS and bp["graphs"] <= GRAPHS
    assert len(manifest["generation"]["graphs"]) == bp["graphs"]
    # the budget is the generator's to keep: the plan says so, and measured nothing for it
    assert "not planned for in a generation spec" in bp["memory_budget"]
    assert manifest["totals"]["records_out"] == 40
    assert [r["id"] for r in completions(out)] == [f"p{i:04d}" for i in range(40)]


def test_plan_prints_the_runs_lists_when_long_prompts_are_rejected_not_cut(tmp_path):
    """data.text.truncate: false: the run's auto prompt axis still ends at the model's limit
    (a longer prompt after the sample is rejected there), and plan plans it the same way."""
    spec = auto_spec(tmp_path, data={"path": str(tmp_path / "prompts.jsonl"), "id_field": "id",
                                     "text": {"field": "prompt", "truncate": False},
                                     "batch_size": 4})
    lists = planned(spec)
    out = tmp_path / "o"
    run = cli("run", spec, "--out", out)
    assert run.exit_code == 0, run.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["bucket_plan"]["buckets"] == lists
    assert lists["seq"][-1] == 1024 - NEW  # the tiny Llama's positions less the new tokens


def test_a_low_graph_bound_holds_with_the_decode_graphs_counted(tmp_path):
    spec = auto_spec(tmp_path, new=40, buckets_max_graphs=7)
    lists = planned(spec)
    manifest = graphrun.run(graphrun.load_spec(spec))
    assert manifest.spec["buckets"] == lists
    counted = graphs_of(lists, 40)
    bp = manifest.bucket_plan
    assert bp.graphs == counted.total <= 7 and bp.max_graphs == 7
    # a fixed batch list keeps its values; the prompt lists fit what is left
    fixed = graphrun.run(graphrun.load_spec(spec, ["buckets.batch=[2, 4]"]), out=tmp_path / "f")
    assert fixed.spec["buckets"]["batch"] == [2, 4]
    assert fixed.bucket_plan.graphs == graphs_of(fixed.spec["buckets"], 40).total <= 7


def test_a_bound_no_plan_can_keep_is_one_message_and_nothing_written(tmp_path):
    spec = auto_spec(tmp_path, new=40, buckets_max_graphs=1)  # 2 at least
    out = tmp_path / "o"
    result = cli("run", spec, "--out", out)
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "buckets_max_graphs" in said and "decode" in said and "raise it" in said
    assert "Traceback" not in result.output and not out.exists()


def test_a_file_of_only_bad_records_names_the_first_and_why(tmp_path):
    """Nothing to plan from: run and plan name the first bad record's line and reason (or say
    the file holds none), not only that no record is valid."""
    spec = auto_spec(tmp_path, n=3)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"id": "a"}\n{"id": "b", "prompt": 5}\n')
    out = tmp_path / "o"
    said = {}
    for verb, args in (("run", ["--out", out]), ("plan", [])):
        result = cli(verb, spec, *args)
        assert result.exit_code == 2, result.output
        said[verb] = " ".join(result.output.split())
        assert "every record read (2) is bad, the first prompts.jsonl:1: missing field " \
               "'prompt'" in said[verb]
    assert "give buckets: lists" in said["run"] and not out.exists()
    data.write_text("")
    said = " ".join(cli("run", spec, "--out", out).output.split())
    assert "no record was read (an empty file or slice)" in said


def test_no_prompt_bucket_passes_the_positions_left_for_the_new_tokens(tmp_path):
    new, positions = 64, 160
    spec = auto_spec(tmp_path, new=new, positions=positions, n=24)
    lists = planned(spec)
    manifest = graphrun.run(graphrun.load_spec(spec))
    seq = manifest.spec["buckets"]["seq"]
    assert seq == lists["seq"]
    # texts are cut at the limit (data.text.truncate: true), so the plan covers it
    assert seq[-1] == positions - new
    rows = completions(tmp_path / "out")
    assert len(rows) == 24 and max(r["prompt_tokens"] for r in rows) == positions - new
    assert manifest.totals.texts_truncated >= 1
