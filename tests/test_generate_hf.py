"""Greedy generation on transformers models equals transformers' own generate, record by
record: a Llama layout with GQA, its Qwen2 and Qwen3 twins and GPT-2, left-padded prompts of
different lengths in one batch, with and without EOS reached, min_new_tokens; unsupported
models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from tests.generate_models import IDS, PROMPTS, hf_greedy, tiny_gpt2, tiny_llama  # noqa: E402

from graphrun.generate import (GenerateConfig, GenerationError, Generator,  # noqa: E402
                               build_generator)

MAKERS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "qwen2": lambda: tiny_llama("qwen2"),
          "qwen3": lambda: tiny_llama("qwen3")}


def run(model, prompts=PROMPTS, ids=IDS, **config):
    gen = build_generator(model, GenerateConfig(**config), batch_buckets=[2, 8],
                          prompt_buckets=[4, 8, 16])
    try:
        return gen.generate(prompts, ids)
    finally:
        gen.close()


def stop_id(rows: list[list[int]], at: int = 3) -> int:
    """A token greedy picks at place `at` of some row and not before it in that row."""
    for row in rows:
        if row[at] not in row[:at]:
            return row[at]
    raise AssertionError("no row has a fresh token at that place")


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_greedy_equals_hf_without_eos(kind):
    model = MAKERS[kind]()
    want = hf_greedy(model, PROMPTS, max_new_tokens=10)
    result = run(model, max_new_tokens=10)
    assert [c.token_ids for c in result.completions] == want
    assert [c.finish_reason for c in result.completions] == ["length"] * len(PROMPTS)
    assert [c.prompt_tokens for c in result.completions] == list(map(len, PROMPTS))
    assert all(c.output_tokens == 10 for c in result.completions)
    assert result.bucket == (8, 16) and result.decode_steps == 9
    assert result.useful_steps == 9 * len(PROMPTS)
    assert model.config._attn_implementation != "graphrun"  # close() gave it back


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_equals_hf_with_eos(kind):
    model = MAKERS[kind]()
    eos = stop_id(hf_greedy(model, PROMPTS, max_new_tokens=12))
    want = hf_greedy(model, PROMPTS, max_new_tokens=12, eos_ids=(eos,))
    result = run(model, max_new_tokens=12, eos_ids=(eos,))
    got = [c.token_ids for c in result.completions]
    assert got == want
    reasons = [c.finish_reason for c in result.completions]
    assert reasons == ["eos" if row[-1] == eos else "length" for row in want]
    assert "eos" in reasons
    assert all(len(row) == 12 for row, r in zip(got, reasons) if r == "length")
    assert result.useful_steps == sum(len(row) - 1 for row in got)


def test_min_new_tokens_masks_eos_until_reached():
    model = tiny_llama()
    eos = stop_id(hf_greedy(model, PROMPTS, max_new_tokens=12), at=1)
    want = hf_greedy(model, PROMPTS, max_new_tokens=12, eos_ids=(eos,), min_new_tokens=5)
    result = run(model, max_new_tokens=12, eos_ids=(eos,), min_new_tokens=5)
    got = [c.token_ids for c in result.completions]
    assert got == want
    assert all(len(row) >= 5 and eos not in row[:4] for row in got)


def test_all_rows_stopping_ends_the_batch_early():
    """A stop id every row hits at once: the host learns it one launch late, so at most two
    steps more run, not max_new_tokens."""
    model = tiny_llama()
    rows = hf_greedy(model, [[40]], max_new_tokens=4)
    result = run(model, prompts=[[40]], ids=[0], max_new_tokens=30, eos_ids=(rows[0][1],))
    assert result.completions[0].token_ids == rows[0][:2]
    assert result.completions[0].finish_reason == "eos"
    assert result.decode_steps <= 3


def test_an_unsupported_transformers_model_is_one_error_before_any_work():
    import transformers

    config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32)
    model = transformers.BertLMHeadModel(config)
    with pytest.raises(GenerationError) as err:
        Generator(model, config=GenerateConfig(max_new_tokens=4), batch_buckets=[1],
                  prompt_buckets=[8], device="cpu", dtype=torch.float32, backend="eager")
    text = str(err.value)
    assert "BertLMHeadModel" in text and "'bert'" in text
    assert "llama" in text and "gpt2" in text and "qwen2" in text


def test_a_plain_module_is_one_error_naming_it():
    with pytest.raises(GenerationError, match="Linear cannot generate.*builtin 'llama'"):
        build_generator(nn.Linear(4, 4), GenerateConfig(max_new_tokens=4), batch_buckets=[1],
                        prompt_buckets=[8])


def test_positions_past_the_model_are_an_error():
    with pytest.raises(GenerationError, match="max_position_embeddings"):
        build_generator(tiny_gpt2(), GenerateConfig(max_new_tokens=100), batch_buckets=[1],
                        prompt_buckets=[64])
