"""Helpers of the generation tests: tiny seeded transformers models and HF's greedy reference."""

from __future__ import annotations

import torch

PROMPTS = [[5, 9, 17, 3], [11, 4, 8, 30, 2, 7, 19, 21, 6, 13, 14], [40], [22, 23, 24, 25, 26, 27],
           [7, 7, 8, 9, 1, 2, 3, 60, 61]]
IDS = ["r0", 1, "r2", 3, "r4"]


def tiny_llama(kind: str = "llama"):
    """A seeded 2-layer Llama layout with GQA (4 heads, 2 kv heads), or its Qwen2 or Qwen3
    twin."""
    import transformers

    torch.manual_seed(0)
    args = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**args))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**args, head_dim=16))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**args))
    return _spread(model.eval())


def tiny_gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=128, bos_token_id=1, eos_token_id=2)
    return _spread(transformers.GPT2LMHeadModel(config).eval())


def _spread(model):
    """Larger weights than the HF init's: logits far apart, so greedy has no near ties and
    completions vary (a tiny model at init repeats one token)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    return model


def hf_greedy(model, prompts, *, max_new_tokens, eos_ids=(), min_new_tokens=0, pad_id=0):
    """transformers' generate(do_sample=False) on the left-padded batch, each row cut after
    its first stop id: the reference graphrun must equal record by record."""
    from transformers import GenerationConfig

    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    config = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                              do_sample=False, eos_token_id=list(eos_ids) or None,
                              pad_token_id=pad_id)
    own = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # no stop ids but the ones given
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, generation_config=config)
    finally:
        model.generation_config.eos_token_id = own
    rows = []
    for row in out[:, longest:].tolist():
        stop = next((i for i, t in enumerate(row) if t in eos_ids), None)
        rows.append(row[:stop + 1] if stop is not None else row[:max_new_tokens])
    return rows


def tiny_causal(kind: str, **changes):
    """A seeded 2-layer transformers causal LM of another family, run through the attention
    hook: gemma (GeGLU, scaled embeddings, head_dim apart from hidden/heads), gemma2 (sliding
    and full layers alternating, its window longer than any record, final logits soft-capped,
    the attention's scores only where attn_logit_softcapping is given), phi
    (partial RoPE, parallel attention and MLP), phi3 (fused qkv), qwen2_moe and mixtral (MoE
    layers: routed experts, a shared expert for Qwen2-MoE)."""
    import transformers

    torch.manual_seed(0)
    args = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    args.update(changes)
    moe = dict(num_experts_per_tok=2, tie_word_embeddings=False)
    configs = {
        "gemma": lambda: transformers.GemmaConfig(**args, head_dim=24,
                                                  tie_word_embeddings=False),
        "gemma2": lambda: transformers.Gemma2Config(
            **{"attn_logit_softcapping": None, "sliding_window": 64, **args}, head_dim=16,
            tie_word_embeddings=False),
        "phi": lambda: transformers.PhiConfig(**args, partial_rotary_factor=0.5),
        "phi3": lambda: transformers.Phi3Config(**args),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **args, **moe, num_experts=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=64),
        "mixtral": lambda: transformers.MixtralConfig(**args, **moe, num_local_experts=4),
    }
    config = configs[kind]()
    model = _spread(transformers.AutoModelForCausalLM.from_config(config).eval())
    if config.to_dict().get("attn_logit_softcapping"):
        # transformers' own eager attention caps the scores; its sdpa, some versions' default
        # for Gemma2, leaves them uncapped, and the reference would be another model
        model.config._attn_implementation = "eager"
    return model
