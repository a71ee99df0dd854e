"""graphrun's Llama: the `llama` builtin, and Llama-family checkpoints (Llama, Mistral, Qwen2,
Qwen3) read from a Hugging Face folder without transformers, both on graphrun's KV cache.

RMSNorm, rotary position embeddings (default, linear or llama3 frequencies), grouped-query
attention (Qwen3's with q and k normed per head), a SwiGLU MLP, an LM head (tied or not).
Parameters carry transformers' names (model.layers.0.self_attn.q_proj.weight, ...), so a
checkpoint's tensors load as saved, and the arithmetic follows transformers' (norms and RoPE in
float32, cast back), so a completion is the one transformers' generate gives
(tests/test_generate_native.py). find_checkpoint and load_checkpoint take GPT-2 folders too
(models/causal/gpt2.py). Attention goes through kv_cache.attend_rotary (kv_cache.attend, as
an adapted transformers model's does, with RoPE inside the decode kernel where it runs). The
elementwise work between the matrix multiplies (a residual add with the norm after it, RoPE,
silu(gate) * up) runs fused Triton kernels where they run (models/causal/fused.py;
Llama.fused_kernels), the same math.

forward(tokens [b, q] int64, positions [b, q] int64, kv: StepKV) -> logits [b, V] float32 of
the last column: the step interface of steps.StepModel.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from graphrun.base.errors import ModelError
from graphrun.models.builtin.seeded import DEFAULT_RULES, Constant, Init, materialise, on_meta, std
from graphrun.models.checkpoint import (CAUSAL_LM_CLASSES, CONFIG_REMEDY, GPT2Shape,
                                        LlamaShape, Rope, built_on_meta, eos_ids_in,
                                        gpt2_shape, inv_freq, llama_shape, load_tensors,
                                        read_folder)
from graphrun.models.sizes import check_fits, tensor_bytes
from graphrun.models.weights import Held, Mismatch, compare, held, weights_error

from graphrun.models.causal import fused
from graphrun.models.causal.gpt2 import GPT2
from graphrun.models.causal.kv_cache import KVLayout, StepKV, attend_rotary

WEIGHT_STD = 0.02  # the builtin's projections; the embedding keeps unit variance (PyTorch's)


class RMSNorm(nn.Module):
    """transformers' Llama norm: the mean square in float32, the weight applied after the
    cast back (nn.RMSNorm with its weight would apply it before). torch's rms_norm without a
    weight computes in float32 and rounds once, as transformers' four steps do, in one call
    (on a GPU one kernel, not seven)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)

    def after_add(self, x: torch.Tensor, delta: torch.Tensor | None,
                  kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this norm of it), one kernel where fused.py's runs; delta None: no add."""
        return fused.add_rms_norm(x, delta, self.weight, self.eps, kernel)

    def seeded_init(self, name: str) -> Init:
        return Constant(1.0)


class Attention(nn.Module):
    def __init__(self, s: LlamaShape, layer: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.layer = (s.heads, s.kv_heads,
                                                                s.head_dim, layer)
        self.q_proj = nn.Linear(s.d_model, s.heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.d_model, s.kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.d_model, s.kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.d_model, bias=s.o_bias)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.norm_eps)
            self.k_norm = RMSNorm(s.head_dim, s.norm_eps)
        self.qk_norm = s.qk_norm
        self.qkv_proj: nn.Linear | None = None  # q, k and v in one, once fused
        self.window = s.window

    def fuse(self) -> None:
        self.qkv_proj = _fused(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: StepKV,
                kernels: bool = False) -> torch.Tensor:
        b, q_len, _ = x.shape  # x: [b, q, d_model]
        h, g, d = self.heads, self.kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qk, v = self.qkv_proj(x).split([(h + g) * d, g * d], dim=-1)
        else:
            qk, v = torch.cat((self.q_proj(x), self.k_proj(x)), dim=-1), self.v_proj(x)
        qk = qk.view(b, q_len, h + g, d)  # q's heads, then k's
        if self.qk_norm:  # per head, over head_dim
            qk = torch.cat((self.q_norm(qk[:, :, :h]), self.k_norm(qk[:, :, h:])), dim=2)
        # RoPE on q and k at once (in the decode kernel where it runs): the same arithmetic
        v = v.view(b, q_len, g, d).transpose(1, 2)
        y = attend_rotary(kv, self.layer, qk, h, v, cos, sin, d ** -0.5, self.window,
                          kernels)  # [b, q, h, d]
        return self.o_proj(y.reshape(b, q_len, -1))


class MLP(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.d_model, s.ffn, bias=s.mlp_bias)
        self.up_proj = nn.Linear(s.d_model, s.ffn, bias=s.mlp_bias)
        self.down_proj = nn.Linear(s.ffn, s.d_model, bias=s.mlp_bias)
        self.gate_up_proj: nn.Linear | None = None  # gate and up in one, once fused

    def fuse(self) -> None:
        self.gate_up_proj = _fused(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, kernels: bool = False) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(fused.silu_mul(gate, up, kernels))


def _fused(*parts: nn.Linear) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side (their weights stacked)."""
    w = parts[0].weight
    fused = nn.Linear(w.shape[1], sum(p.out_features for p in parts),
                      bias=parts[0].bias is not None, device="meta", dtype=w.dtype)
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), w.requires_grad)
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), w.requires_grad)
    return fused


class Layer(nn.Module):
    """Pre-norm block: attention, then the MLP, each residual. The MLP's output is added by
    the next layer (or the final norm), in one kernel with that norm."""

    def __init__(self, s: LlamaShape, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(s.d_model, s.norm_eps)
        self.self_attn = Attention(s, layer)
        self.post_attention_layernorm = RMSNorm(s.d_model, s.norm_eps)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos, sin, kv: StepKV,
                kernels: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # x: the residual stream [b, q, d_model] before the previous MLP's output delta (None
        # at the first layer) -> (the residual stream before this MLP's output, that output)
        x, h = self.input_layernorm.after_add(x, delta, kernels)
        x, h = self.post_attention_layernorm.after_add(
            x, self.self_attn(h, cos, sin, kv, kernels), kernels)
        return x, self.mlp(h, kernels)


class Body(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.d_model)
        self.layers = nn.ModuleList(Layer(s, i) for i in range(s.layers))
        self.norm = RMSNorm(s.d_model, s.norm_eps)


class Llama(nn.Module):
    """Built on the meta device (build_llama, load_checkpoint); make_scratch once the weights have
    values. eos_ids and pad_id: a checkpoint's own (its config files), None for the builtin."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape, self.vocab, self.max_len = shape, shape.vocab, shape.max_len
        self.layout = KVLayout(shape.layers, shape.heads, shape.kv_heads, shape.head_dim)
        self.window, self.softcap = shape.window, None  # what its attention asks beside keys
        self.eos_ids: tuple[int, ...] | None = None
        self.pad_id: int | None = None
        self.model = Body(shape)
        self.lm_head = nn.Linear(shape.d_model, shape.vocab, bias=False)
        if shape.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", None, persistent=False)  # [head_dim / 2] float32
        # fused.py's kernels where they run; False: torch's ops (bench_decode_step's unfused way)
        self.fused_kernels = True
        self.register_load_state_dict_post_hook(lambda module, _keys: module.make_scratch())

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """q, k, v and gate, up each become one matrix multiply: at a decode step's few rows a
        projection is bound by reading its weights, and one larger read in one kernel runs
        nearer the bandwidth than several small ones. The parameters' names change
        (qkv_proj, gate_up_proj), so a checkpoint loads before this, never after."""
        if any(p.is_meta for p in self.parameters()):
            raise ValueError("fuse_projections: the weights must have values first")
        for layer in self.model.layers:
            if layer.self_attn.qkv_proj is None:
                layer.self_attn.fuse()
                layer.mlp.fuse()

    @torch.no_grad()
    def make_scratch(self) -> None:
        """RoPE's frequencies, made where the weights are (None while they are on meta)."""
        weight = self.lm_head.weight
        if not weight.is_meta:
            self.inv_freq = inv_freq(self.shape.rope, self.shape.head_dim).to(weight.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                kv: StepKV) -> torch.Tensor:
        # tokens, positions: [b, q] -> logits [b or n, V] in the weights' dtype
        # (StepKV.last_hidden); the step casts them into its float32 buffer
        x = self.model.embed_tokens(tokens)  # [b, q, d_model]
        # cos, sin: [b, 1, q, head_dim], computed in float32 then cast, as transformers does
        freqs = positions[..., None].float() * self.inv_freq  # [b, q, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        kernels, delta = self.fused_kernels, None
        for layer in self.model.layers:
            x, delta = layer(x, delta, cos, sin, kv, kernels)
        # the rows whose logits are asked, then the last residual add with the final norm
        last = kv.last_hidden(delta) if delta is not None else None
        _, h = self.model.norm.after_add(kv.last_hidden(x), last, kernels)
        return self.lm_head(h)


def _linear(module: nn.Module, name: str) -> Init:
    return std(WEIGHT_STD) if name == "weight" else Constant(0.0)


RULES = DEFAULT_RULES | {nn.Linear: _linear}


def build_llama(layers: int = 2, d_model: int = 64, heads: int = 4, kv_heads: int | None = None,
                vocab: int = 512, max_len: int = 512, ffn: int | None = None, seed: int = 0,
                device=None, dtype: torch.dtype | None = None) -> Llama:
    """The builtin: the same arguments give the same weights on any device (builtin/seeded.py).
    Its shape: builtin_shape."""
    shape = builtin_shape(layers, d_model, heads, kv_heads, vocab, max_len, ffn)
    with on_meta():
        model = Llama(shape)
    materialise(model, seed, device, dtype, RULES)
    model.make_scratch()
    return model.eval()


def builtin_shape(layers: int = 2, d_model: int = 64, heads: int = 4,
                  kv_heads: int | None = None, vocab: int = 512, max_len: int = 512,
                  ffn: int | None = None, seed: int = 0) -> LlamaShape:
    """The builtin's shape from its arguments (build_llama's; seed changes only the weights).
    kv_heads defaults to heads (no GQA); ffn to 8/3 d_model rounded up to 16, as Llama sizes
    it. max_len is the longest prompt + completion the model is meant for (RoPE needs no
    table, so it only documents the limit the generator checks)."""
    kv_heads = kv_heads or heads
    if d_model % heads or heads % kv_heads:
        raise ValueError(f"llama: d_model ({d_model}) must be divisible by heads ({heads}) and "
                         f"heads by kv_heads ({kv_heads})")
    if (d_model // heads) % 2:
        raise ValueError(f"llama: head_dim d_model / heads ({d_model // heads}) must be even "
                         "for rotary embeddings")
    ffn = ffn or -(-(8 * d_model // 3) // 16) * 16
    return LlamaShape(layers=layers, d_model=d_model, heads=heads, kv_heads=kv_heads,
                      head_dim=d_model // heads, ffn=ffn, vocab=vocab, max_len=max_len,
                      norm_eps=1e-5, rope=Rope())


OwnLM = (Llama, GPT2)  # the causal LMs graphrun runs on its own code


def _build(shape) -> "Llama | GPT2":
    return GPT2(shape) if isinstance(shape, GPT2Shape) else Llama(shape)


def _head_name(model) -> str:
    return "transformer.wte.weight" if isinstance(model, GPT2) else "model.embed_tokens.weight"


def saved_name(shape, name: str) -> str | None:
    """A checkpoint's tensor name as graphrun's model names it; None for what it leaves out
    (GPT-2's causal-mask buffers, which older transformers saved). GPT-2 checkpoints saved
    from GPT2Model (openai-community/gpt2's) lack the `transformer.` prefix."""
    if isinstance(shape, GPT2Shape):
        if name.endswith((".attn.bias", ".attn.masked_bias")) and ".c_" not in name:
            return None
        if not name.startswith(("transformer.", "lm_head.")):
            return "transformer." + name
    return name


def weight_mismatch(model, saved: dict[str, Held]) -> Mismatch:
    """How a checkpoint's tensors differ from this model's; a tied head may be saved or not."""
    want = held(model.state_dict())
    saved = {n: h for x, h in saved.items() if (n := saved_name(model.shape, x)) is not None}
    if model.shape.tied:
        want.pop("lm_head.weight")
        saved.pop("lm_head.weight", None)
    return compare(want, saved)


def load_checkpoint(found: "Checkpoint", device: torch.device, dtype: torch.dtype):
    """A checkpoint's weights in graphrun's Llama or GPT-2 on `device` in `dtype`: built on
    meta, each tensor read onto the device and cast as it becomes the parameter."""
    shape, folder = found.shape, found.folder
    check_fits(f"model.hf {str(folder)!r}", found.elements * dtype.itemsize, dtype, device,
               "give a smaller model.dtype (bfloat16 halves it) or a device with more memory")
    with on_meta():
        model = _build(shape)
    tensors = load_tensors(found.files, device)
    differ = weight_mismatch(model, held(tensors))
    if differ:  # find_checkpoint checked the headers: the files changed since
        raise weights_error(f"model.hf {str(folder)!r}", differ, "they changed since they "
                            "were checked; run again")
    weights = {saved_name(shape, n): t.to(dtype) for n, t in tensors.items()}
    weights.pop(None, None)
    if shape.tied:
        weights["lm_head.weight"] = weights[_head_name(model)]
    model.load_state_dict(weights, assign=True)
    if shape.tied:  # assign replaced the shared parameter: share it again
        model.lm_head.weight = model.get_parameter(_head_name(model))
    model.eos_ids, model.pad_id = found.eos_ids, found.pad_id
    model.make_scratch()
    return model.eval()


@dataclass(frozen=True)
class Checkpoint:
    """A Hugging Face folder graphrun's Llama or GPT-2 can load: its shape, weight files, stop
    and pad ids (generation_config.json's, else config.json's, as transformers reads them)."""

    folder: Path
    shape: "LlamaShape | GPT2Shape"
    files: list[Path]
    eos_ids: tuple[int, ...]
    pad_id: int | None
    elements: int = 0  # the saved tensors' values, all together


def find_checkpoint(folder: str | Path, class_: str, kwargs: dict) -> Checkpoint | str:
    """The folder as a Checkpoint, or why graphrun's own code cannot load it as transformers
    would (then transformers does): read from config.json and the safetensors headers only."""
    if class_ not in CAUSAL_LM_CLASSES:
        return f"class {class_} (graphrun's own code loads {', '.join(CAUSAL_LM_CLASSES)})"
    read = read_folder(folder, kwargs)
    if isinstance(read, str):
        return read
    config, files, headers = read
    where = f"model.hf {str(folder)!r}"
    try:
        shape = gpt2_shape(config) if config.get("model_type") == "gpt2" else llama_shape(config)
    except ModelError as e:  # a size no model has: transformers' class would fail on it too
        raise ModelError(f"{where}: {e}") from None
    if isinstance(shape, str):
        return shape
    with on_meta():
        differ = weight_mismatch(built_on_meta(where, _build, shape), headers)
    if differ.missing or differ.unexpected:  # saved under names transformers may map
        return (f"the weights' names are not a {shape.family} causal LM's "
                f"(missing {differ.missing[:2]}, unexpected {differ.unexpected[:2]})")
    if differ:
        raise weights_error(where, differ, CONFIG_REMEDY)
    pad = config.get("pad_token_id")
    return Checkpoint(Path(folder), shape, files, eos_ids_in(folder),
                      int(pad[0] if isinstance(pad, list) else pad) if pad is not None else None,
                      tensor_bytes((h.shape for h in headers.values()), 1))
