"""model.compile for generation: the steps run torch.compile's kernels around graphrun's
attention operator, one compilation per kind rather than per bucket, the completions those of
the plain model; a compiler that fails leaves the job running on the plain model, with the
reason."""

from __future__ import annotations

import json

import pytest
import torch

import graphrun
from graphrun.generate import GenerateConfig, Engine, Sampling, build_llama
from tests.children import imports_of
from tests.test_generate_job import FOLDER, completions, write_spec

PROMPTS = [[3, 8, 1], [9] * 12, [4, 5, 6, 7, 8], [2], [11, 12, 13, 14, 15, 16, 17]]
IDS = [f"rec-{i}" for i in range(len(PROMPTS))]


def generate(model, *, compile: bool, sampling=Sampling(), **kw):
    gen = Engine(model, config=GenerateConfig(max_new_tokens=10, sampling=sampling),
                    slots=8, max_prompt=16, device="cpu",
                    dtype=torch.float32, backend="eager", compile=compile, **kw)
    try:
        out = [gen.generate(PROMPTS, IDS), gen.generate(PROMPTS[:1], IDS[:1])]
        return [[c.token_ids for c in r] for r in out], gen.graphs()
    finally:
        gen.close()


@pytest.mark.slow
def test_compiled_steps_give_the_plain_models_tokens_and_compile_once_per_kind():
    """One layer with a sliding window (the torch path: the kernel has none, as a Mistral
    checkpoint's 4-token window sets it) and one without (graphrun's attention operator), both
    in one compiled step: one compilation serves both paths."""
    model = build_llama(layers=2, d_model=64, heads=4, kv_heads=2, vocab=128, max_len=64)
    model.model.layers[0].self_attn.window = 4
    plain, _ = generate(model, compile=False)
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["stats"]
    before = frames["unique_graphs"]
    got, buckets = generate(model, compile=True)
    assert got == plain
    assert buckets and all(b["compiled"] is True for b in buckets), buckets
    # prefill and decode, each for one row and for many: not one per bucket
    assert len(buckets) > 4 and frames["unique_graphs"] - before <= 4
    # the window changed the completions: its path ran
    model.model.layers[0].self_attn.window = None
    unwindowed, _ = generate(model, compile=False)
    assert unwindowed != plain


def test_a_compiler_failure_leaves_every_graph_on_the_plain_model_with_the_reason():
    from graphrun.generate import compiled

    calls = []

    class Broken(compiled.CompiledStep):
        def __call__(self, tokens, positions, kv):
            calls.append(tokens.shape)
            raise RuntimeError("inductor exploded\nstack line")

    model = build_llama(layers=2, d_model=64, heads=4, kv_heads=2, vocab=128, max_len=64)
    plain, _ = generate(model, compile=False)
    got, buckets = generate(model, compile=True, compiler=Broken)
    assert got == plain
    assert len(calls) == 1  # tried once, then never again
    assert all(b["compiled"] is False for b in buckets)
    assert {b["reason"] for b in buckets} == {
        "no CUDA device: backend eager; model.compile failed, runs without it: RuntimeError: "
        "inductor exploded"}


def test_only_the_one_row_decode_step_compiles_under_coordinate_descent_tuning():
    from graphrun.generate import compiled

    seen = []
    step = compiled.CompiledStep.__new__(compiled.CompiledStep)
    step._fn = lambda tokens, positions, kv: seen.append(
        (tuple(tokens.shape), torch._inductor.config.coordinate_descent_tuning))
    for shape in [(1, 1), (1, 16), (4, 1), (4, 16)]:
        step(torch.zeros(shape, dtype=torch.long), None, None)
    assert seen == [((1, 1), True), ((1, 16), False), ((4, 1), False), ((4, 16), False)]
    assert torch._inductor.config.coordinate_descent_tuning is False


def test_a_compile_job_reports_its_compiled_graphs_in_the_manifest(tmp_path):
    from functools import partial

    from graphrun.generate import compiled
    from graphrun.generate.runner import GenerationRunner
    from graphrun.job.parts import JobParts

    # the compiler itself is the slow test's; here the job's wiring, on a stand-in that runs
    # the plain model
    class Plain(compiled.CompiledStep):
        def __call__(self, tokens, positions, kv):
            return self.plain(tokens, positions, kv)

    parts = JobParts(generation_runner=partial(GenerationRunner, compiler=Plain))
    for name in ("plain", "compiled"):
        (tmp_path / name).mkdir()
    graphrun.run(graphrun.load_spec(write_spec(tmp_path / "plain", n=6)))
    spec = write_spec(tmp_path / "compiled", n=6, model={
        "hf": {"path": str(FOLDER), "class": "AutoModelForCausalLM"}, "dtype": "float32",
        "compile": True})
    manifest = graphrun.run(graphrun.load_spec(spec), parts=parts)
    graphs = manifest.generation.graphs
    assert graphs and all(g.compiled is True for g in graphs)
    from graphrun.job.progress import generation_line

    assert generation_line(manifest.generation).endswith(
        f"; model.compile: {len(graphs)} of {len(graphs)} graphs compiled")
    got = [r["token_ids"] for r in completions(tmp_path / "compiled" / "out")]
    want = [r["token_ids"] for r in completions(tmp_path / "plain" / "out")]
    assert got == want
    off = json.loads((tmp_path / "plain" / "out" / "manifest.json").read_text())
    assert {g["compiled"] for g in off["generation"]["graphs"]} == {None}


def test_half_precision_compiled_picks_may_differ_only_at_near_ties():
    from graphrun.generate.graphs import compare_runs

    want_logits = torch.tensor([[2.0, 1.98, -1.0]])
    near = torch.tensor([[1.99, 2.0, -1.0]])  # 0.01 off: token 1 now, a near tie of token 0
    far = torch.tensor([[1.9, 1.9, 2.5]])  # token 2, 3 below the plain pick's logit
    want = ([torch.tensor([0])], [want_logits])
    tie = compare_runs(([torch.tensor([1])], [near]), want, torch.bfloat16, 1, compiled=True)
    assert tie["passed"] and tie["token_mismatches"] == 0
    wrong = compare_runs(([torch.tensor([2])], [far]), want, torch.bfloat16, 1, compiled=True)
    assert not wrong["passed"]
    # after a near tie the row is fed another token: its later, other picks are not counted
    later = torch.tensor([[0.5, -1.0, 3.0]])
    two = ([torch.tensor([0]), torch.tensor([2])], [want_logits, later])
    tie_then_other = compare_runs(([torch.tensor([1]), torch.tensor([0])], [near, later * 0]),
                                  two, torch.bfloat16, 1, compiled=True)
    assert tie_then_other["passed"] and tie_then_other["token_mismatches"] == 0
    # the capture itself gets no such slack
    assert not compare_runs(([torch.tensor([1])], [near]), want, torch.bfloat16, 1)["passed"]


def test_a_job_without_compile_never_imports_torchs_compiler(tmp_path):
    # graphrun::attend is traced only under torch.compile: an eager call of the operator
    # would import the compiler, seconds of every job's first graph set-up
    (tmp_path / "job").mkdir()
    spec = write_spec(tmp_path / "job", n=4)
    assert imports_of(spec, "torch._dynamo", "torch._inductor") == {
        "torch._dynamo": False, "torch._inductor": False}
