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

from graphrun.generate import (GenerateConfig, GenerationError, Engine,  # noqa: E402
                               build_engine)

MAKERS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "qwen2": lambda: tiny_llama("qwen2"),
          "qwen3": lambda: tiny_llama("qwen3")}


def run(model, prompts=PROMPTS, ids=IDS, **config):
    gen = build_engine(model, GenerateConfig(**config), slots=8, max_prompt=16)
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
    assert [c.token_ids for c in result] == want
    assert [c.finish_reason for c in result] == ["length"] * len(PROMPTS)
    assert [c.prompt_tokens for c in result] == list(map(len, PROMPTS))
    assert all(c.output_tokens == 10 for c in result)
    assert model.config._attn_implementation != "graphrun"  # close() gave it back


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_equals_hf_with_eos(kind):
    model = MAKERS[kind]()
    eos = stop_id(hf_greedy(model, PROMPTS, max_new_tokens=12))
    want = hf_greedy(model, PROMPTS, max_new_tokens=12, eos_ids=(eos,))
    result = run(model, max_new_tokens=12, eos_ids=(eos,))
    got = [c.token_ids for c in result]
    assert got == want
    reasons = [c.finish_reason for c in result]
    assert reasons == ["eos" if row[-1] == eos else "length" for row in want]
    assert "eos" in reasons
    assert all(len(row) == 12 for row, r in zip(got, reasons) if r == "length")


def test_min_new_tokens_masks_eos_until_reached():
    model = tiny_llama()
    eos = stop_id(hf_greedy(model, PROMPTS, max_new_tokens=12), at=1)
    want = hf_greedy(model, PROMPTS, max_new_tokens=12, eos_ids=(eos,), min_new_tokens=5)
    result = run(model, max_new_tokens=12, eos_ids=(eos,), min_new_tokens=5)
    got = [c.token_ids for c in result]
    assert got == want
    assert all(len(row) >= 5 and eos not in row[:4] for row in got)


def test_an_unsupported_transformers_model_is_one_error_before_any_work():
    import transformers

    config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32)
    model = transformers.BertLMHeadModel(config)
    with pytest.raises(GenerationError) as err:
        Engine(model, config=GenerateConfig(max_new_tokens=4), slots=1, max_prompt=8, device="cpu", dtype=torch.float32, backend="eager")
    text = str(err.value)
    assert "BertLMHeadModel" in text and "'bert'" in text
    assert "llama" in text and "gpt2" in text and "qwen2" in text


def test_a_plain_module_is_one_error_naming_it():
    with pytest.raises(GenerationError, match="Linear cannot generate.*builtin 'llama'"):
        build_engine(nn.Linear(4, 4), GenerateConfig(max_new_tokens=4), slots=1, max_prompt=8)


def test_positions_past_the_model_are_an_error():
    with pytest.raises(GenerationError, match="max_position_embeddings"):
        build_engine(tiny_gpt2(), GenerateConfig(max_new_tokens=100), slots=1, max_prompt=64)
