"""On a GPU: the captured prefill and decode graphs give the tokens eager gives (greedy and
seeded sampling), each graph verified at capture; a transformers Llama too."""

from __future__ import annotations

import time

import pytest
import torch

from graphrun.generate import GenerateConfig, Generator, Sampling, build_llama

pytestmark = pytest.mark.cuda

PROMPTS = [[3, 8, 1], [9] * 12, [4, 5, 6, 7, 8], [2], [11, 12, 13, 14, 15, 16, 17]]
IDS = [f"rec-{i}" for i in range(len(PROMPTS))]
SAMPLE = Sampling(method="sample", temperature=1.5, top_k=20, top_p=0.9, seed=11)


def completions(model, backend, sampling, dtype=torch.float32, prompts=PROMPTS, **kw):
    gen = Generator(model, config=GenerateConfig(max_new_tokens=24, sampling=sampling),
                    batch_buckets=[1, 4, 8], prompt_buckets=[4, 16], device="cuda",
                    dtype=dtype, backend=backend, **kw)
    try:
        out = [gen.generate(prompts, IDS[:len(prompts)]),
               gen.generate(prompts[:1], IDS[:1])]  # a second batch on other buckets
        return [[c.token_ids for c in r.completions] for r in out], gen.buckets(), out
    finally:
        gen.close()


@pytest.mark.parametrize("sampling", [Sampling(), SAMPLE], ids=["greedy", "sample"])
def test_captured_graphs_give_eager_tokens(sampling):
    model = build_llama(layers=2, d_model=64, heads=4, kv_heads=2, vocab=128, max_len=64,
                        device="cuda")
    eager, _, _ = completions(model, "eager", sampling)
    graphs, buckets, results = completions(model, "cuda-graph", sampling)
    assert graphs == eager
    assert buckets and all(b["status"] == "captured" for b in buckets), buckets
    assert all(b["verify"]["passed"] and b["capture_s"] > 0 for b in buckets)
    assert {b["kind"] for b in buckets} == {"prefill", "decode"}
    assert all(r.prefill_s > 0 and r.decode_s > 0 and r.ttft_s >= r.prefill_s
               for r in results)


def test_every_bucket_set_up_at_once_largest_first_into_one_pool():
    model = build_llama(layers=2, d_model=64, heads=4, vocab=128, max_len=64, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    graphs, buckets, _ = completions(model, "cuda-graph", Sampling(), lazy=False, pool=pool)
    eager, _, _ = completions(model, "eager", Sampling())
    assert graphs == eager
    assert {b["set_up"] for b in buckets} == {"setup"}
    prefill = [b for b in buckets if b["kind"] == "prefill"]
    assert prefill[0]["shape"] == {"rows": 8, "prompt": 16}


def test_bfloat16_graphs_match_bfloat16_eager():
    model = build_llama(layers=2, d_model=64, heads=4, kv_heads=2, vocab=128, max_len=64,
                        device="cuda", dtype=torch.bfloat16)
    eager, _, _ = completions(model, "eager", Sampling(), dtype=torch.bfloat16)
    graphs, buckets, _ = completions(model, "cuda-graph", Sampling(), dtype=torch.bfloat16)
    assert graphs == eager
    assert all(b["status"] == "captured" for b in buckets)


def test_transformers_llama_graphs_equal_eager_and_hf():
    pytest.importorskip("transformers")
    from tests.generate_models import hf_greedy, tiny_llama

    model = tiny_llama().cuda()
    graphs, buckets, _ = completions(model, "cuda-graph", Sampling())
    eager, _, _ = completions(model, "eager", Sampling())
    assert graphs == eager
    assert all(b["status"] == "captured" for b in buckets), buckets
    assert model.config._attn_implementation != "graphrun"
    want = hf_greedy(model.cpu(), PROMPTS, max_new_tokens=24)
    assert graphs[0] == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_steps_are_captured_and_verified_against_the_plain_model(dtype):
    model = build_llama(layers=2, d_model=64, heads=4, kv_heads=2, vocab=128, max_len=64,
                        device="cuda", dtype=dtype)
    plain, _, _ = completions(model, "cuda-graph", Sampling(), dtype=dtype)
    got, buckets, _ = completions(model, "cuda-graph", Sampling(), dtype=dtype, compile=True)
    assert all(b["status"] == "captured" and b["compiled"] is True and b["verify"]["passed"]
               for b in buckets), buckets
    if dtype == torch.float32:
        assert got == plain
    else:  # inductor rounds bf16 in its own order: near ties may flip, the rest agree
        rows = [(a, b) for part_a, part_b in zip(got, plain) for a, b in zip(part_a, part_b)]
        assert sum(a[:4] == b[:4] for a, b in rows) >= len(rows) - 1


def test_decode_steps_the_device_waited_on_the_host_for_are_counted(monkeypatch):
    from graphrun.generate import graphs

    model = build_llama(layers=1, d_model=32, heads=4, kv_heads=2, vocab=128, max_len=64,
                        device="cuda")
    gen = Generator(model, config=GenerateConfig(max_new_tokens=12), batch_buckets=[4],
                    prompt_buckets=[16], device="cuda", dtype=torch.float32,
                    backend="cuda-graph")
    try:
        gen.generate(PROMPTS[:4], IDS[:4])  # the graphs set up, outside what is counted
        kv_for = gen._kv_for

        def slow_host(columns):  # between a launch and the next: its step long done
            time.sleep(0.003)
            return kv_for(columns)

        monkeypatch.setattr(gen, "_kv_for", slow_host)
        waited = gen.generate(PROMPTS[:4], IDS[:4])
        monkeypatch.setattr(gen, "_kv_for", kv_for)
        replay = graphs.StepGraph.run

        def slow_device(self):  # about a millisecond of the device's time before each step
            torch.cuda._sleep(2_000_000)
            replay(self)

        monkeypatch.setattr(graphs.StepGraph, "run", slow_device)
        ahead = gen.generate(PROMPTS[:4], IDS[:4])
    finally:
        gen.close()
    assert waited.decode_steps == ahead.decode_steps == 11
    assert waited.host_bound_steps == 11
    assert ahead.host_bound_steps == 0
