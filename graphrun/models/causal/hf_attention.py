"""Transformers causal LMs on graphrun's KV cache: an attention function registered with
transformers under the name `graphrun`, and the adapter that drives the model with it.

transformers still computes q, k, v and RoPE; the registered function (set on the model's
config as `_attn_implementation`) receives them per layer and calls kv_cache.attend, which
writes the step's keys into graphrun's paged cache and attends over it.
The step's StepKV reaches it as a keyword argument of the model call, which transformers hands
down to every attention call: no module is modified and no global holds a batch.
The mask is graphrun's own 4-D boolean one, passed as the attention mask; transformers returns
a 4-D mask unchanged, so none of its mask code (or host syncs) runs.

Any causal LM whose transformers class routes its attention through that interface runs so
(its class's _supports_attention_backend), transformers computing everything but the attention:
norms, RoPE of any kind, MLP or MoE. The softcap and sliding_window arguments of the call are
applied by graphrun's attention (kv_cache.attend). A model the cache cannot serve
(check_supported: an attention of its own, an encoder-decoder, recurrent or other non-attention
layers, attention sinks, keys and values of different widths) gets one GenerationError naming
what and why, before any work.
"""

from __future__ import annotations

import torch

from graphrun.base.errors import GenerationError
from graphrun.models.causal.kv_cache import KVLayout, StepKV, attend

ATTENTION_NAME = "graphrun"
# attention layer kinds (config.layer_types) graphrun's cache holds: every key of the row, the
# sliding ones only while the window covers the whole record (check_supported)
ATTENTION_LAYERS = ("full_attention", "sliding_attention")
# keyword arguments of an attention call that change what it computes, which graphrun's paged
# attention does not do: their name -> what it is, for the message
UNSUPPORTED_ARGS = {"s_aux": "attention sinks"}


def graphrun_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       graphrun_kv: StepKV | None = None, **kwargs):
    """transformers' attention interface: query [b, heads, q, d], key/value [b, kv_heads, q, d]
    -> ([b, q, heads, d], no weights). The mask comes from graphrun_kv, not attention_mask."""
    name = type(module).__name__
    if graphrun_kv is None:
        raise GenerationError(
            f"{name}: the attention implementation {ATTENTION_NAME!r} only "
            "runs inside a graphrun Generator; set config._attn_implementation back (e.g. "
            "'sdpa') to call the model directly, or call Generator.close()")
    for arg, what in UNSUPPORTED_ARGS.items():
        if kwargs.get(arg) is not None:  # check_supported refuses the configs it knows of
            raise GenerationError(f"{name}: {what} ({arg}) is not supported by graphrun's "
                                  "paged attention; run this model with transformers' generate")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise GenerationError(f"{name} has no layer_idx: graphrun cannot tell which layer's "
                              "cache it reads; run this model with transformers' generate")
    return attend(graphrun_kv, layer, query, key, value, scaling, kwargs.get("softcap"),
                  kwargs.get("sliding_window")), None


def register() -> None:
    """Add graphrun's function to transformers' table (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, graphrun_attention)


def is_hf_model(model) -> bool:
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "model_type") and callable(model)


def unsupported(model) -> GenerationError:
    return GenerationError(
        f"{type(model).__name__} cannot generate with graphrun: generation needs a causal LM: "
        "the builtin 'llama', or a transformers causal LM (AutoModelForCausalLM) whose "
        "attention goes through transformers' attention interface")


def check_supported(model, max_len: int) -> None:
    """One error, before any work, for a model graphrun's KV cache cannot serve correctly."""
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise GenerationError(f"{type(model).__name__} has no language-model head: load it "
                              "with AutoModelForCausalLM (e.g. LlamaForCausalLM, GPT2LMHeadModel)")
    sinks = any(n.rsplit(".", 1)[-1] == "sinks" for n, _ in model.named_parameters())
    problem = (layout_problem(type(model), model.config, max_len, sinks=sinks)
               or attention_problem(model))
    if problem is not None:
        raise refusal(type(model), model.config, problem)


# hf.kwargs that only say which config to read: any other may change it, so only the loaded
# model is checked then
WHICH_CONFIG = ("revision", "subfolder", "cache_dir")


def check_before_loading(hf, where: str, max_len: int) -> None:
    """layout_problem from the folder's config.json and the class model.hf.class picks for it,
    before any weight is read. A config or class this cannot read is left to the loader (and
    to check_supported on the loaded model)."""
    if set(hf.kwargs) - set(WHICH_CONFIG):
        return
    try:
        import transformers

        config = transformers.AutoConfig.from_pretrained(
            where, local_files_only=True, trust_remote_code=hf.trust_remote_code, **hf.kwargs)
        cls = getattr(transformers, hf.class_)
        mapping = getattr(cls, "_model_mapping", None)
        if mapping is not None:  # an Auto class: the one it picks for this config
            cls = mapping[type(config)]
    except Exception:  # noqa: BLE001 - the loader says what is missing or wrong
        return
    problem = layout_problem(cls, config, max_len)
    if problem is not None:
        raise refusal(cls, config, problem)


def refusal(cls, config, problem: str) -> GenerationError:
    kind = getattr(config, "model_type", None)
    return GenerationError(f"{cls.__name__} (model_type {kind!r}) cannot generate with "
                           f"graphrun: {problem}")


def layout_problem(cls, config, max_len: int, sinks: bool = False) -> str | None:
    """Why a transformers class and config cannot run on graphrun's KV cache (what, and what to
    do), or None."""
    own = "; run it with transformers' own generate"
    if config.is_encoder_decoder or getattr(config, "add_cross_attention", False):
        return ("it is an encoder-decoder (cross-attention over an encoder's output): graphrun's "
                "cache holds one causal sequence per record" + own)
    if not getattr(cls, "_supports_attention_backend", False):
        return ("its attention does not go through transformers' attention interface "
                f"({cls.__name__}._supports_attention_backend is False), so graphrun cannot "
                "reach its keys and values" + own)
    dynamic = getattr(cls, "_supports_default_dynamic_cache", None)
    if dynamic is not None and not dynamic():
        return "it needs a cache class of its own (recurrent state)" + own
    other = sorted({t for t in getattr(config, "layer_types", None) or []
                    if t not in ATTENTION_LAYERS})
    if other:
        return (f"it has layers of kind {', '.join(other)} (config.layer_types), which keep a "
                "state or see keys graphrun's cache does not hold (only full_attention and "
                "sliding_attention layers run)" + own)
    if sinks:
        return "attention sinks (the attention's 'sinks' parameters) are not in graphrun's " \
               "paged attention" + own
    v_dim, head_dim = getattr(config, "v_head_dim", None), layout_of(config).head_dim
    if v_dim is not None and v_dim != getattr(config, "qk_head_dim", head_dim):
        return (f"its keys and values have different widths (v_head_dim={v_dim}): graphrun's "
                "cache holds keys and values of one head_dim" + own)
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and max_len > positions:
        return (f"the longest prompt bucket + max_new_tokens is {max_len} tokens, past the "
                f"model's max_position_embeddings ({positions}): lower buckets.seq or "
                "generate.max_new_tokens")
    return None


def attention_problem(model) -> str | None:
    """Why the model's attention layers cannot use graphrun's cache, or None: each must be
    causal and name its layer (its cache) within the config's layers."""
    layers = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "layer_idx")]
    count = layout_of(model.config).layers
    if not layers:
        return ("no attention layer with a layer_idx found, so graphrun cannot tell which "
                "layer's cache each reads; run it with transformers' own generate")
    for m in layers:
        if not m.is_causal:
            return (f"its attention is bidirectional ({type(m).__name__}.is_causal is False): "
                    "generation needs a causal LM (a decoder: load it with "
                    "AutoModelForCausalLM, and is_decoder=True where the config has it)")
        if not isinstance(m.layer_idx, int) or not 0 <= m.layer_idx < count:
            return (f"{type(m).__name__}.layer_idx is {m.layer_idx!r}, outside the config's "
                    f"{count} layers; run it with transformers' own generate")
    return None


def sliding_window(config) -> int | None:
    """The window a layer of the model attends within, or None: a Qwen-style flag that turns it
    off, or layer_types without a sliding layer, leave every layer full."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    kinds = getattr(config, "layer_types", None)
    return None if kinds and "sliding_attention" not in kinds else window


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
        # what its attention asks beside the keys (runner.decode_attention reads them)
        self.window = sliding_window(model.config)
        self.softcap = getattr(model.config, "attn_logit_softcapping", None)
        self._previous = model.config._attn_implementation
        model.config._attn_implementation = ATTENTION_NAME

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor,
                 kv: StepKV) -> torch.Tensor:
        # tokens, positions: [b, q] -> logits [b or n, V] as the model gives them, cast by
        # the step (StepKV.last_hidden). No cache object: the keys live in graphrun's cache,
        # reached through graphrun_kv. A 4-D mask passes through transformers unchanged, so
        # none of its mask code runs; graphrun_attention reads what it needs from kv.
        mask = torch.ones((tokens.shape[0], 1, 1, 1), dtype=torch.bool, device=tokens.device)
        keep = kv.last if kv.prefill else 1
        out = self.model(input_ids=tokens, position_ids=positions, attention_mask=mask,
                         use_cache=False, logits_to_keep=keep, graphrun_kv=kv)
        return out.logits[0] if kv.prefill else out.logits[:, -1]

    def close(self) -> None:
        """The model's attention implementation as it was."""
        self.model.config._attn_implementation = self._previous
