"""Greedy generation on transformers models equals transformers' own generate, record by
record: a Llama layout with GQA, its Qwen2 and Qwen3 twins, GPT-2, and other families through
the attention hook (Gemma, Gemma2 soft-capped and windowed, Phi, Phi3, Qwen2-MoE, Mixtral, a
windowed Mistral), prompts of different lengths in one batch, with and without EOS reached,
min_new_tokens; models graphrun's cache cannot serve, each refused naming what and why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from tests.generate_models import (IDS, PROMPTS, _spread, hf_greedy, tiny_causal,  # noqa: E402
                                   tiny_gpt2, tiny_llama)

from graphrun.generate import (GenerateConfig, GenerationError, Engine,  # noqa: E402
                               build_engine)

MAKERS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "qwen2": lambda: tiny_llama("qwen2"),
          "qwen3": lambda: tiny_llama("qwen3"),
          **{kind: (lambda kind=kind: tiny_causal(kind))
             for kind in ("gemma", "gemma2", "phi", "phi3", "qwen2_moe", "mixtral")}}


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


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma", "mixtral"])
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


def engine_error(model, max_prompt: int = 8, max_new_tokens: int = 4) -> str:
    """The engine's error for a model it refuses, before it computes anything."""
    with pytest.raises(GenerationError) as err:
        Engine(model, config=GenerateConfig(max_new_tokens=max_new_tokens), slots=1,
               max_prompt=max_prompt, device="cpu", dtype=torch.float32, backend="eager")
    return str(err.value)


SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def refused(name: str):
    """A tiny transformers model graphrun's cache cannot serve, and what its error names."""
    import transformers as t

    return {
        "bidirectional": (lambda: t.BertLMHeadModel(t.BertConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32)), ["BertLMHeadModel", "'bert'", "bidirectional",
                                     "BertSelfAttention.is_causal"]),
        "own attention": (lambda: t.BloomForCausalLM(t.BloomConfig(
            vocab_size=96, hidden_size=32, n_layer=2, n_head=4)),
            ["BloomForCausalLM", "attention interface", "_supports_attention_backend"]),
        "encoder-decoder": (lambda: t.T5ForConditionalGeneration(t.T5Config(
            vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)),
            ["T5ForConditionalGeneration", "encoder-decoder"]),
        "recurrent layers": (lambda: t.Lfm2ForCausalLM(t.Lfm2Config(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2,
            layer_types=["conv", "full_attention"])), ["Lfm2ForCausalLM", "kind conv"]),
        "sinks": (lambda: t.GptOssForCausalLM(t.GptOssConfig(
            **SMALL, head_dim=8, num_local_experts=2, num_experts_per_tok=1)),
            ["GptOssForCausalLM", "attention sinks"]),
        "latent attention": (lambda: t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
            vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8)), ["DeepseekV3ForCausalLM", "v_head_dim=8"]),
    }[name]


@pytest.mark.parametrize("name", ["bidirectional", "own attention", "encoder-decoder",
                                  "recurrent layers", "sinks",
                                  "latent attention"])
def test_a_model_the_cache_cannot_serve_is_one_error_naming_what(name):
    make, named = refused(name)
    model = make()
    implementation = model.config._attn_implementation
    text = engine_error(model)
    assert all(part in text for part in named), text
    assert "cannot generate with graphrun" in text
    assert model.config._attn_implementation == implementation  # nothing was changed


def test_the_attention_refuses_sinks_it_was_not_told_of():
    from graphrun.models.causal.hf_attention import graphrun_attention

    q = torch.zeros(1, 2, 1, 4)
    module = nn.Module()
    module.layer_idx = 0
    with pytest.raises(GenerationError, match="attention sinks"):
        graphrun_attention(module, q, q, q, None, graphrun_kv=object(), s_aux=torch.zeros(2))


def test_gemma2s_soft_capped_attention_equals_transformers():
    """Scores large enough (query_pre_attn_scalar 1) for the cap to change every record's
    tokens: graphrun's completions follow the capped model, not the uncapped one."""
    capped = tiny_causal("gemma2", attn_logit_softcapping=1.0, query_pre_attn_scalar=1)
    want = hf_greedy(capped, PROMPTS, max_new_tokens=10)
    uncapped = hf_greedy(tiny_causal("gemma2", query_pre_attn_scalar=1), PROMPTS,
                         max_new_tokens=10)
    assert all(a != b for a, b in zip(want, uncapped))
    assert [c.token_ids for c in run(capped, max_new_tokens=10)] == want


def tiny_mistral(window: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        sliding_window=window)
    return _spread(transformers.MistralForCausalLM(config).eval())


@pytest.mark.parametrize("kind", ["gemma2", "mistral"])
def test_a_sliding_window_shorter_than_the_records_equals_transformers(kind):
    """A window of 4 tokens on prompts of up to 11 and 10 new tokens: graphrun's completions
    follow the windowed model, not the one that sees every key (Gemma2: its sliding layers
    beside full ones; Mistral: every layer)."""
    make = ((lambda w: tiny_causal("gemma2", sliding_window=w)) if kind == "gemma2"
            else tiny_mistral)
    windowed = make(4)
    want = hf_greedy(windowed, PROMPTS, max_new_tokens=10)
    assert want != hf_greedy(make(64), PROMPTS, max_new_tokens=10)
    assert [c.token_ids for c in run(windowed, max_new_tokens=10)] == want


def test_a_plain_module_is_one_error_naming_it():
    with pytest.raises(GenerationError, match="Linear cannot generate.*builtin 'llama'"):
        build_engine(nn.Linear(4, 4), GenerateConfig(max_new_tokens=4), slots=1, max_prompt=8)


def test_positions_past_the_model_are_an_error():
    with pytest.raises(GenerationError, match="max_position_embeddings"):
        build_engine(tiny_gpt2(), GenerateConfig(max_new_tokens=100), slots=1, max_prompt=64)


def save_with_tokenizer(folder, kind: str):
    """A tiny model of `kind` (vocab the shipped tiny Llama's tokenizer's) saved with
    save_pretrained beside that tokenizer's files: a folder as a user brings one."""
    import shutil
    from pathlib import Path

    import transformers

    model = tiny_causal(kind, vocab_size=512, bos_token_id=0, eos_token_id=1)
    model.save_pretrained(folder)
    tiny = Path(__file__).resolve().parents[1] / "examples" / "models" / "tiny-llama"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny / name, folder / name)
    return transformers.AutoTokenizer.from_pretrained(folder), model


def job_spec(tmp_path, folder, texts, new: int = 6):
    import json

    import yaml

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n"
                               for i, t in enumerate(texts)))
    spec = {"version": 1, "name": "gen", "device": "cpu",
            "model": {"hf": {"path": str(folder), "class": "AutoModelForCausalLM"},
                      "dtype": "float32"},
            "data": {"path": str(prompts), "id_field": "id", "text": {"field": "prompt"},
                     "batch_size": 2},
            "generate": {"max_new_tokens": new},
            "buckets": {"batch": [2], "seq": [32]},
            "output": {"dir": str(tmp_path / "out"), "format": "jsonl"}}
    path = tmp_path / "gen.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("kind", ["gemma", "phi3", "qwen2_moe"])
def test_a_job_on_a_saved_folder_of_another_family_equals_transformers(tmp_path, kind):
    import json

    import graphrun

    tok, model = save_with_tokenizer(tmp_path / "m", kind)
    texts = ["the cat sat on", "a dog", "once upon a time there", "hello"]
    manifest = graphrun.run(graphrun.load_spec(job_spec(tmp_path, tmp_path / "m", texts)))
    rows = [json.loads(line) for p in sorted((tmp_path / "out").glob("part-*.jsonl"))
            for line in p.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(len(texts)))
    for row, text in zip(rows, texts):
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                 do_sample=False)
        want = out[0, ids.shape[1]:].tolist()
        assert row["token_ids"] == want, row["id"]
        assert row["text"] == tok.decode(want, skip_special_tokens=True)
    assert manifest.environment.model_code == "transformers"
    assert f"model_type '{kind}'" in manifest.environment.model_code_reason


def test_a_job_on_a_model_the_cache_cannot_serve_fails_before_reading_its_weights(tmp_path):
    import transformers

    import graphrun

    folder = tmp_path / "m"
    config = transformers.BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4)
    transformers.BloomForCausalLM(config).save_pretrained(folder)
    (folder / "model.safetensors").unlink()  # refused from config.json: never read
    (folder / "tokenizer.json").write_text("{}")  # the spec's check: a tokenizer is there
    with pytest.raises(GenerationError, match=r"BloomForCausalLM \(model_type 'bloom'\) "
                                              r"cannot generate.*attention interface"):
        graphrun.run(graphrun.load_spec(job_spec(tmp_path, folder, ["a b c"])))
    assert not list((tmp_path / "out").glob("part-*"))
