"""The packed prefill's attention by the prompts' boundaries (models/causal/packed_attention.py):
on the CPU, a stand-in for the flash kernel that reads only `starts` gives the masked
attention's completions on jobs of mixed prompts, padding, several samples of a prompt and a
sliding window, so the engine's boundaries are right wherever the kernel runs; on a GPU, the
kernel itself against the masked attention, and in captured prefill graphs."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from graphrun.generate.config import GenerateConfig, Sampling  # noqa: E402
from graphrun.generate.engine import build_engine  # noqa: E402
from graphrun.models.causal import kv_cache, packed_attention  # noqa: E402
from graphrun.spec.request import RequestParams  # noqa: E402
from tests.generate_models import IDS, PROMPTS, tiny_llama  # noqa: E402

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)


def by_starts(q, k, v, starts, scale, window=None):
    """What the flash kernel computes, from `starts` alone: token t belongs to the sequence
    whose start is the last one at or before t, and sees that sequence's tokens up to itself
    (and within the window)."""
    n = q.shape[2]
    at = torch.arange(n, device=q.device)
    seq = torch.searchsorted(starts.long(), at, right=True) - 1
    sees = (seq[:, None] == seq[None, :]) & (at[None, :] <= at[:, None])
    if window is not None:
        sees &= at[:, None] - at[None, :] < window
    return kv_cache.fresh_attend(q, k, v, sees[None, None], scale)


def stand_in(monkeypatch) -> list:
    """The kernel's place taken by by_starts on the CPU; each call's `starts` checked (int32,
    from 0 to the pack's end, never falling). A prefill that reads no cached block must not
    build the mask. The calls' `starts`, returned."""
    calls = []
    real_mask = kv_cache.StepKV.mask

    def attend(q, k, v, starts, scale, window=None):
        calls.append(starts.clone())
        assert starts.dtype == torch.int32 and bool((starts[1:] >= starts[:-1]).all())
        assert int(starts[0]) == 0 and int(starts[-1]) == q.shape[2]
        return by_starts(q, k, v, starts, scale, window)

    def mask(self):
        assert self.prefix is not None, "the masked attention's mask was built"
        return real_mask.fget(self)

    monkeypatch.setattr(packed_attention, "runs", lambda q, softcap: softcap is None)
    monkeypatch.setattr(packed_attention, "attend", attend)
    monkeypatch.setattr(kv_cache.StepKV, "mask", property(mask))
    return calls


def completions(model, config, prompts, slots, params=None):
    eng = build_engine(copy.deepcopy(model), config, slots=slots, max_prompt=16, block_size=4)
    try:
        return [(c.token_ids, c.finish_reason) for c in eng.generate(prompts, None, params)]
    finally:
        eng.close()


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_greedy_by_the_prompts_boundaries_equals_the_masked_attention(monkeypatch, slots):
    model = tiny_llama()
    config = GenerateConfig(max_new_tokens=10, eos_ids=(2,))
    want = completions(model, config, PROMPTS, slots)
    calls = stand_in(monkeypatch)
    assert completions(model, config, PROMPTS, slots) == want
    assert calls, "no prefill ran through the stand-in"
    if slots > 1:  # some pack holds several prompts
        assert any(int((c[1:] > c[:-1]).sum()) > 1 for c in calls)


def test_samples_of_a_prompt_and_a_sliding_window_by_the_boundaries(monkeypatch):
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(**BASE, sliding_window=3)
    model = transformers.MistralForCausalLM(config).eval()
    gen = GenerateConfig(max_new_tokens=6, n=2, sampling=Sampling(method="sample",
                                                                  temperature=1.5, seed=3))
    prompts = [PROMPTS[i % len(PROMPTS)][:4 + i] for i in range(6)]
    params = [RequestParams(n=1 + i % 3) for i in range(6)]
    want = completions(model, gen, prompts, 4, params)
    calls = stand_in(monkeypatch)
    assert completions(model, gen, prompts, 4, params) == want
    assert calls and len(want) == 1 + 2 + 3 + 1 + 2 + 3


# ---- on a GPU -------------------------------------------------------------------------------


def packed(lengths, total, heads, kv_heads, d, seed=0):
    gen = torch.Generator("cuda").manual_seed(seed)

    def randn(h):
        return torch.randn(1, h, total, d, generator=gen, device="cuda", dtype=torch.bfloat16)

    cuts = [0]
    for n in lengths:
        cuts.append(cuts[-1] + n)
    slots = 2 + len(lengths)
    starts = torch.full((slots + 2,), total, dtype=torch.int32, device="cuda")
    starts[:len(cuts)] = torch.tensor(cuts, dtype=torch.int32)
    return randn(heads), randn(kv_heads), randn(kv_heads), starts, cuts[-1]


@pytest.mark.cuda
@pytest.mark.parametrize("heads,kv_heads,d,window", [(12, 12, 64, None), (32, 8, 64, None),
                                                      (32, 8, 128, None), (8, 2, 64, 5)])
def test_the_flash_kernel_equals_the_masked_attention_on_every_real_token(heads, kv_heads, d,
                                                                          window):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, k, v, starts, real = packed([7, 1, 30, 12], 64, heads, kv_heads, d)
    if not packed_attention.runs(q, None):
        pytest.skip(f"the flash kernel does not run here ({packed_attention.failure()})")
    got = packed_attention.attend(q, k, v, starts, d ** -0.5, window)
    want = by_starts(q, k, v, starts, d ** -0.5, window)
    assert got.shape == want.shape == (1, 64, heads, d)
    assert torch.isfinite(got).all()  # the padding's too: it is written to the trash block
    err = (got[:, :real].float() - want[:, :real].float()).abs().max().item()
    assert err < 2e-2, err


@pytest.mark.cuda
def test_captured_prefills_run_the_flash_kernel_and_replay_what_eager_computes():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = tiny_llama().to("cuda", torch.bfloat16)
    probe = torch.zeros(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16)
    if not packed_attention.runs(probe, None):
        pytest.skip(f"the flash kernel does not run here ({packed_attention.failure()})")
    config = GenerateConfig(max_new_tokens=8, eos_ids=(2,))
    graphs = build_engine(copy.deepcopy(model), config, slots=4, max_prompt=16, block_size=4,
                          device="cuda", dtype=torch.bfloat16, backend="cuda-graph")
    eager = build_engine(copy.deepcopy(model), config, slots=4, max_prompt=16, block_size=4,
                         device="cuda", dtype=torch.bfloat16, backend="eager")
    got = [c.token_ids for c in graphs.generate(PROMPTS, IDS)]
    assert got == [c.token_ids for c in eager.generate(PROMPTS, IDS)]
    assert packed_attention.failure() is None
    prefills = [e for k, e in graphs.table.entries.items() if k.kind == "prefill"]
    assert prefills and all(e.graph is not None for e in prefills), [e.reason for e in prefills]
