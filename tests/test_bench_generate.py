"""benchmarks/bench_generate.py's own logic on the CPU: the prompts, the id tokenizer that lets
graphrun read them as text, the hand loop's tokens against HF static-cache greedy, and the
graphrun row's one-line failure."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_generate",
                                                  ROOT / "benchmarks" / "bench_generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def tiny(bench, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    bench.save_folder("tiny", folder, torch.device("cpu"), torch.float32, max_positions=96)
    model, _ = bench.load_model(folder, torch.device("cpu"), torch.float32)
    return folder, model


def test_prompt_lengths_are_seeded_bounded_and_long_tailed(bench):
    a = bench.make_prompts(400, 1000, 16, 512, seed=3)
    assert a == bench.make_prompts(400, 1000, 16, 512, seed=3)
    lengths = sorted(map(len, a))
    assert lengths[0] >= 16 and lengths[-1] <= 512
    assert lengths[200] < 100 < lengths[-1]  # median short, tail long
    assert all(0 < t < 1000 for p in a for t in p)  # the pad id 0 never in a prompt


def test_text_prompts_tokenize_back_to_the_ids(bench, tiny):
    folder, _ = tiny
    prompts = bench.make_prompts(8, 512, 4, 30)
    bench.check_round_trip(folder, prompts)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok(bench.as_text([5, 511, 1]))["input_ids"] == [5, 511, 1]


def test_the_hand_loop_equals_hf_static_greedy_on_left_padded_batches(bench, tiny):
    _, model = tiny
    prompts = bench.make_prompts(6, 512, 3, 20, seed=5)
    hand = bench.hand_batch(model, prompts, 6)
    static = bench.hf_batch(model, prompts, 6, "static")
    assert hand.tokens == static.tokens
    assert all(len(t) == 6 for t in hand.tokens)
    assert 0 < hand.ttft_s <= hand.wall_s


def test_a_time_boxed_job_says_how_many_prompts_ran_and_projects(bench, tiny):
    _, model = tiny
    prompts = bench.make_prompts(8, 512, 3, 10)
    row, tokens = bench.run_job("eager", model, 0.5, prompts, 2, 3, 0.0, "tiny")
    assert (row.prompts_run, row.prompts_total, row.projected) == (2, 8, True)
    assert sorted(tokens) == [0, 1] and "2/8 prompts" in row.note
    assert row.job_wall_s > row.setup_s + row.generate_s
    assert set(row.ttft_ms) == {"p50", "p99"}


def test_a_graphrun_that_cannot_run_the_spec_is_one_line(bench, tiny, tmp_path, monkeypatch):
    folder, _ = tiny
    prompts = bench.make_prompts(4, 512, 3, 10)
    # a prompt field graphrun refuses: the run fails, the row says so in one line
    # a patch: the benchmark script's own constant (benchmarks/, not graphrun)
    monkeypatch.setattr(bench, "GRAPHRUN_SPEC", bench.GRAPHRUN_SPEC.replace(
        "max_new_tokens: {new}", "max_new_tokens: 0"))
    row, tokens = bench.run_graphrun(folder, prompts, 4, 2, 3, torch.device("cpu"), "float32",
                                     tmp_path / "w", "tiny", timeout=120)
    assert row.status == "failed" and tokens == {}
    assert row.note.startswith("graphrun could not run this generate: spec (exit 2): error:")
    assert "max_new_tokens" in row.note and "\n" not in row.note


def test_the_graphrun_row_reads_its_manifest_and_completions(bench, tiny, tmp_path,
                                                             monkeypatch):
    """A stand-in for the finished run: the row takes tokens/s, TTFT and the completions from
    what graphrun wrote, and projects the prompts it left out by its streaming time."""
    import json
    import subprocess

    folder, _ = tiny
    prompts = bench.make_prompts(8, 512, 3, 10)

    def finished(cmd, cwd, **kwargs):
        out = Path(cwd) / "out"
        out.mkdir()
        spec = (Path(cwd) / "gen.yaml").read_text()
        assert "stop: {eos: none}" in spec and "batch: [2]" in spec
        (out / "part-00000.jsonl").write_text("".join(
            json.dumps({"id": i, "token_ids": [7, 7, 7]}) + "\n" for i in range(4)))
        (out / "manifest.json").write_text(json.dumps({
            "totals": {"setup_s": 1.5, "stream_s": 2.0},
            "generation": {"output_tokens": 12, "output_tokens_per_s": 40.0, "prefill_s": 0.1,
                           "decode_s": 0.2, "ttft_ms": {"p50": 3.0, "p90": 4.0, "p99": 5.0},
                           "tpot_ms": {"p50": 1.0, "p99": 2.0}}}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    # a patch: the graphrun process (subprocess) stood in
    monkeypatch.setattr(bench.subprocess, "run", finished)
    row, tokens = bench.run_graphrun(folder, prompts, 4, 2, 3, torch.device("cpu"), "float32",
                                     tmp_path / "w", "tiny", timeout=60)
    assert row.status == "ok", row.note
    assert tokens == {i: [7, 7, 7] for i in range(4)}
    assert (row.prompts_run, row.output_tokens, row.setup_s) == (4, 12, 1.5)
    assert row.tokens_per_s_generate == 40.0 and row.ttft_ms == {"p50": 3.0, "p99": 5.0}
    assert row.projected and row.job_wall_s == pytest.approx(
        row.graphrun["process_wall_s"] + 2.0)  # 8 prompts: the stream once more
