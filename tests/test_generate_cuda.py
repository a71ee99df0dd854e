"""On a GPU: the engine's captured prefill and decode graphs give the tokens eager gives (greedy
and seeded sampling), each graph verified at capture; a transformers Llama too, and other
transformers families through the attention hook (Gemma, Gemma2 soft-capped, Phi, Phi3, MoE)."""

from __future__ import annotations

import time

import pytest
import torch

from graphrun.generate import Engine, GenerateConfig, Sampling, build_llama

pytestmark = pytest.mark.cuda

PROMPTS = [[3, 8, 1], [9] * 12, [4, 5, 6, 7, 8], [2], [11, 12, 13, 14, 15, 16, 17]]
IDS = [f"rec-{i}" for i in range(len(PROMPTS))]
SAMPLE = Sampling(method="sample", temperature=1.5, top_k=20, top_p=0.9, seed=11)


def completions(model, backend, sampling, dtype=torch.float32, prompts=PROMPTS, **kw):
    gen = Engine(model, config=GenerateConfig(max_new_tokens=24, sampling=sampling), slots=4,
                 max_prompt=16, rows=[1, 4], device="cuda", dtype=dtype, backend=backend,
                 block_size=4, **kw)
    try:
        out = [gen.generate(prompts, IDS[:len(prompts)]),
               gen.generate(prompts[:1], IDS[:1])]  # one row alone: the smallest graph
        return [[c.token_ids for c in r] for r in out], gen.graphs(), gen.stats
    finally:
        gen.close()


@pytest.mark.parametrize("sampling", [Sampling(), SAMPLE], ids=["greedy", "sample"])
def test_captured_graphs_give_eager_tokens(sampling):
    model = build_llama(layers=2, d_model=64, heads=4, kv_heads=2, vocab=128, max_len=64,
                        device="cuda")
    eager, _, _ = completions(model, "eager", sampling)
    graphs, buckets, stats = completions(model, "cuda-graph", sampling)
    assert graphs == eager
    assert buckets and all(b["status"] == "captured" for b in buckets), buckets
    assert all(b["verify"]["passed"] and b["capture_s"] > 0 for b in buckets)
    assert {b["kind"] for b in buckets} == {"prefill", "decode"}
    assert stats.prefill_s > 0 and stats.decode_s > 0 and stats.ttft.percentiles([50])


def test_every_bucket_set_up_at_once_largest_first_into_one_pool():
    model = build_llama(layers=2, d_model=64, heads=4, vocab=128, max_len=64, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    graphs, buckets, _ = completions(model, "cuda-graph", Sampling(), pool=pool)
    eager, _, _ = completions(model, "eager", Sampling())
    assert graphs == eager
    assert {b["set_up"] for b in buckets} == {"setup"}
    assert [b["shape"] for b in buckets] == [{"tokens": 16}, {"rows": 4}, {"rows": 1}]


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


MOE = ("qwen2_moe", "mixtral")


@pytest.mark.parametrize("kind", ["gemma", "gemma2-capped", "phi", "phi3", *MOE])
def test_other_transformers_families_graphs_equal_eager_and_hf(kind):
    """Through the attention hook: the dense families' steps are all captured; an MoE's steps
    are captured where transformers' experts code can be (else they run eagerly, saying why),
    and the tokens are transformers' either way."""
    pytest.importorskip("transformers")
    from tests.generate_models import hf_greedy, tiny_causal

    extra = {"attn_logit_softcapping": 1.0, "query_pre_attn_scalar": 1} if "capped" in kind else {}
    model = tiny_causal(kind.split("-")[0], **extra).cuda()
    graphs, buckets, _ = completions(model, "cuda-graph", Sampling())
    eager, _, _ = completions(model, "eager", Sampling())
    assert graphs == eager
    if kind in MOE:
        assert all(b["status"] == "captured" or b["reason"] for b in buckets), buckets
    else:
        assert all(b["status"] == "captured" for b in buckets), buckets
    want = hf_greedy(model.cpu(), PROMPTS, max_new_tokens=24)
    assert graphs[0] == want


@pytest.mark.parametrize("kind", MOE)
def test_moe_steps_in_bfloat16_are_captured(kind):
    """transformers' default experts code (grouped_mm) has no host sync on a GPU in bf16."""
    pytest.importorskip("transformers")
    from tests.generate_models import tiny_causal

    model = tiny_causal(kind).cuda().to(torch.bfloat16)
    graphs, buckets, _ = completions(model, "cuda-graph", Sampling(), dtype=torch.bfloat16)
    eager, _, _ = completions(model, "eager", Sampling(), dtype=torch.bfloat16)
    assert graphs == eager
    assert all(b["status"] == "captured" for b in buckets), buckets


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
    from graphrun.generate import engine as engine_module

    model = build_llama(layers=1, d_model=32, heads=4, kv_heads=2, vocab=128, max_len=64,
                        device="cuda")
    gen = Engine(model, config=GenerateConfig(max_new_tokens=12), slots=4, max_prompt=16,
                 device="cuda", dtype=torch.float32, backend="cuda-graph")
    try:
        prompts = [p[:4] for p in PROMPTS[:4]]  # one prefill, then 11 decode steps
        decode = engine_module.Engine._decode

        def slow_host(self, **kw):  # between a launch and the next: its step long done
            time.sleep(0.003)
            return decode(self, **kw)

        # patches: a slow host, then a slow device, stood in on this engine's own steps
        monkeypatch.setattr(engine_module.Engine, "_decode", slow_host)
        gen.generate(prompts, IDS[:4])
        waited = gen.stats.host_bound_steps
        monkeypatch.setattr(engine_module.Engine, "_decode", decode)
        # about ten milliseconds of the device's time before each step: a margin a fresh
        # machine's first-call hiccups on the host stay within
        def slow_device(replay):
            def run():
                torch.cuda._sleep(20_000_000)
                replay()
            return run

        for entry in gen.table.entries.values():
            monkeypatch.setattr(entry, "run", slow_device(entry.run))
        gen.generate(prompts, IDS[:4])
        ahead = gen.stats.host_bound_steps - waited
    finally:
        gen.close()
    assert gen.stats.decode_steps == 22
    assert waited >= 10  # the first decode step follows the prefill, which it may find done
    assert ahead == 0


def test_slots_auto_fill_half_the_free_memory_in_whole_eights():
    from graphrun.generate.engine import AUTO_SLOTS

    model = build_llama(layers=2, d_model=64, heads=4, kv_heads=2, vocab=128, max_len=64,
                        device="cuda")
    gen = Engine(model, config=GenerateConfig(max_new_tokens=8), slots="auto", max_prompt=16,
                 device="cuda", dtype=torch.float32, backend="cuda-graph")
    try:
        assert gen.slots == AUTO_SLOTS  # a tiny model's cache: the cap, not the memory
        assert len(gen.generate([[1, 2, 3]] * 3)) == 3
    finally:
        gen.close()
