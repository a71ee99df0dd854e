"""The builtin llama generates, deterministically; a record's completion does not depend on
its batch size, its row, its neighbours or the buckets (greedy and seeded sampling); the
generator's accounting and its errors."""

from __future__ import annotations

import pytest
import torch

from graphrun.generate import (GenerateConfig, GenerationError, Sampling, build_engine,
                               build_llama)

PROMPTS = [[3, 8, 1], [9] * 12, [4, 5, 6, 7, 8], [2], [11, 12, 13, 14, 15, 16, 17],
           [20, 21], [30, 31, 32, 33], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]
IDS = [f"rec-{i}" for i in range(len(PROMPTS))]
SAMPLE = Sampling(method="sample", temperature=1.5, top_k=20, top_p=0.9, seed=11)


def model(seed: int = 0):
    return build_llama(layers=2, d_model=32, heads=4, kv_heads=2, vocab=64, max_len=64,
                       seed=seed)


def generator(m, sampling=Sampling(), max_new=8, **config):
    return build_engine(m, GenerateConfig(max_new_tokens=max_new, sampling=sampling,
                                             **config),
                           slots=8, max_prompt=16)


def by_id(gen, prompts, ids) -> dict:
    result = gen.generate(prompts, ids)
    return {rid: c.token_ids for rid, c in zip(ids, result)}


@pytest.mark.parametrize("sampling", [Sampling(), SAMPLE], ids=["greedy", "sample"])
def test_same_completion_at_every_batch_size_and_row(sampling):
    gen = generator(model(), sampling)
    full = by_id(gen, PROMPTS, IDS)  # batch 8, prompt bucket 16
    for size in (1, 3):  # batch buckets 1 and 4; short groups pick smaller prompt buckets
        for start in range(0, len(PROMPTS), size):
            part = by_id(gen, PROMPTS[start:start + size], IDS[start:start + size])
            assert part == {rid: full[rid] for rid in part}
    backwards = by_id(gen, PROMPTS[::-1], IDS[::-1])  # every record in another row
    assert backwards == full


def test_sampled_completions_follow_seed_and_record_id():
    m = model()
    first = by_id(generator(m, SAMPLE), PROMPTS, IDS)
    assert by_id(generator(m, SAMPLE), PROMPTS, IDS) == first  # a rerun, a new generator
    other = Sampling(method="sample", temperature=1.5, top_k=20, top_p=0.9, seed=12)
    assert by_id(generator(m, other), PROMPTS, IDS) != first
    renamed = by_id(generator(m, SAMPLE), PROMPTS, [f"x{i}" for i in range(len(PROMPTS))])
    assert list(renamed.values()) != list(first.values())


def test_first_tokens_over_many_records_follow_the_softmax():
    """The same prompt for 400 record ids: its first token's frequencies match
    softmax(prefill logits / temperature)."""
    m = build_llama(layers=1, d_model=32, heads=2, vocab=12, max_len=32, seed=5)
    with torch.no_grad():  # larger logits: a distribution with some shape, not uniform
        m.lm_head.weight.mul_(20.0)
    s = Sampling(method="sample", temperature=2.0, seed=0)
    gen = build_engine(m, GenerateConfig(max_new_tokens=1, sampling=s), slots=8, max_prompt=4)
    tokens = []
    for batch in range(50):
        result = gen.generate([[1, 2, 3]] * 8, [batch * 8 + i for i in range(8)])
        tokens += [c.token_ids[0] for c in result]
    probs = (gen.state.logits[0] / 2.0).softmax(-1).double()
    counts = torch.bincount(torch.tensor(tokens), minlength=12).double()
    expected = probs * len(tokens)
    chi = float(((counts - expected) ** 2 / expected).sum())
    assert chi < 31.3  # 11 degrees of freedom, the 0.999 quantile
    assert probs.max() < 0.5  # a distribution, not a near-certain token


def test_the_builtin_is_deterministic_and_seeded():
    prompts, ids = PROMPTS[:4], IDS[:4]
    a = by_id(generator(model(0)), prompts, ids)
    assert by_id(generator(model(0)), prompts, ids) == a
    assert by_id(generator(model(1)), prompts, ids) != a
    assert all(len(tokens) == 8 for tokens in a.values())
    assert len({tuple(t) for t in a.values()}) > 1  # the prompts matter


def test_stop_ids_and_min_new_tokens_on_the_builtin():
    m = model()
    free = by_id(generator(m), PROMPTS, IDS)
    eos = next(t[2] for t in free.values() if t[2] not in t[:2])
    stopped = by_id(generator(m, eos_ids=(eos,)), PROMPTS, IDS)
    for rid, tokens in free.items():
        cut = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert stopped[rid] == tokens[:cut]
    late = generator(m, eos_ids=(eos,), min_new_tokens=6).generate(PROMPTS, IDS)
    assert all(c.output_tokens >= 6 for c in late)
    assert all(eos not in c.token_ids[:5] for c in late)


def test_errors_say_what_to_do():
    gen = generator(model())
    with pytest.raises(GenerationError, match="record 'e'.*0 tokens"):
        gen.generate([[1], []], ["d", "e"])
    with pytest.raises(GenerationError, match="record 7.*17 tokens"):
        gen.generate([[1] * 17], [7])
    with pytest.raises(GenerationError, match="min_new_tokens is 9"):
        generator(model(), min_new_tokens=9)
    with pytest.raises(GenerationError, match="outside the model's vocabulary of 64"):
        generator(model(), eos_ids=(64,))
    with pytest.raises(GenerationError, match="past the model's max_len"):
        generator(model(), max_new=60)
    with pytest.raises(GenerationError, match="memory_budget_mib"):
        build_engine(model(), GenerateConfig(max_new_tokens=8), slots=8, max_prompt=16, memory_budget_mib=0.01)
