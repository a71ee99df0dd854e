"""Transformers causal LMs on graphrun's KV cache: an attention function registered with
transformers under the name `graphrun`, and the adapter that drives the model with it.

transformers still computes q, k, v and RoPE; the registered function (set on the model's
config as `_attn_implementation`) receives them per layer and calls kv_cache.attend, which
writes the step's keys into graphrun's paged cache and attends over it.
The step's StepKV reaches it as a keyword argument of the model call, which transformers hands
down to every attention call: no module is modified and no global holds a batch.
The mask is graphrun's own 4-D boolean one, passed as the attention mask; transformers returns
a 4-D mask unchanged, so none of its mask code (or host syncs) runs.

Only layouts whose attention goes through that interface with plain causal, full attention are
accepted (SUPPORTED); any other model gets one GenerationError before any work.
"""

from __future__ import annotations

import torch

from graphrun.generate.config import GenerationError
from graphrun.generate.kv_cache import KVLayout, StepKV, attend

ATTENTION_NAME = "graphrun"
# model_type -> the architecture family, for the messages
SUPPORTED = {"llama": "Llama", "mistral": "Llama (Mistral)", "qwen2": "Llama (Qwen2)",
             "qwen3": "Llama (Qwen3)", "gpt2": "GPT-2"}


def graphrun_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       graphrun_kv: StepKV | None = None, **kwargs):
    """transformers' attention interface: query [b, heads, q, d], key/value [b, kv_heads, q, d]
    -> ([b, q, heads, d], no weights). The mask comes from graphrun_kv, not attention_mask."""
    if graphrun_kv is None:
        raise GenerationError(
            f"{type(module).__name__}: the attention implementation {ATTENTION_NAME!r} only "
            "runs inside a graphrun Generator; set config._attn_implementation back (e.g. "
            "'sdpa') to call the model directly, or call Generator.close()")
    return attend(graphrun_kv, module.layer_idx, query, key, value, scaling), None


def register() -> None:
    """Add graphrun's function to transformers' table (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, graphrun_attention)


def is_hf_model(model) -> bool:
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "model_type") and callable(model)


def unsupported(model) -> GenerationError:
    kinds = ", ".join(f"{t} ({f})" for t, f in SUPPORTED.items())
    return GenerationError(
        f"{type(model).__name__} cannot generate with graphrun: generation needs a causal LM "
        f"whose layout graphrun's KV cache supports: the builtin 'llama', or a transformers "
        f"model of model_type {kinds}; use one of those, or run this model with "
        "transformers' own generate")


def check_supported(model, max_len: int) -> None:
    """One error, before any work, for a model this adapter cannot drive correctly."""
    config = model.config
    kind = getattr(config, "model_type", None)
    name = type(model).__name__
    if kind not in SUPPORTED:
        raise GenerationError(f"{name} (model_type {kind!r}): " + str(unsupported(model)))
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise GenerationError(f"{name} has no language-model head: load it with "
                              "AutoModelForCausalLM (e.g. LlamaForCausalLM, GPT2LMHeadModel)")
    if getattr(config, "add_cross_attention", False) or config.is_encoder_decoder:
        raise GenerationError(f"{name}: cross-attention is not supported for generation")
    window = getattr(config, "sliding_window", None)
    if kind in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        window = None
    if window is not None and window < max_len:
        raise GenerationError(
            f"{name}: sliding-window attention (sliding_window={window}) is not supported; "
            f"keep the longest prompt bucket + max_new_tokens ({max_len}) within the window")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and max_len > positions:
        raise GenerationError(
            f"{name}: the longest prompt bucket + max_new_tokens is {max_len} tokens, past "
            f"the model's max_position_embeddings ({positions}): lower buckets.seq or "
            "generate.max_new_tokens")


def layout_of(config) -> KVLayout:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVLayout(config.num_hidden_layers, heads, kv_heads, head_dim)


def eos_ids_of(model) -> tuple[int, ...]:
    """The model's own stop ids: its generation_config's eos_token_id, else its config's."""
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()


class HFCausalLM:
    """The step interface (steps.StepModel) over a transformers causal LM."""

    def __init__(self, model, max_len: int):
        check_supported(model, max_len)
        register()
        self.model = model.eval()
        self.layout = layout_of(model.config)
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self._previous = model.config._attn_implementation
        model.config._attn_implementation = ATTENTION_NAME

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor,
                 kv: StepKV) -> torch.Tensor:
        # tokens, positions: [b, q] -> logits [b or n, V] float32 (StepKV.last_hidden). No
        # cache object: the keys live in graphrun's cache, reached through graphrun_kv. A 4-D
        # mask passes through transformers unchanged, so none of its mask code runs.
        if kv.prefill:
            mask, keep = kv.mask, kv.last
        else:
            mask, keep = torch.ones((tokens.shape[0], 1, 1, 1), dtype=torch.bool,
                                    device=tokens.device), 1
        out = self.model(input_ids=tokens, position_ids=positions, attention_mask=mask,
                         use_cache=False, logits_to_keep=keep, graphrun_kv=kv)
        return (out.logits[0] if kv.prefill else out.logits[:, -1]).float()

    def close(self) -> None:
        """The model's attention implementation as it was."""
        self.model.config._attn_implementation = self._previous
