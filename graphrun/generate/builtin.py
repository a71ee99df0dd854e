"""The `llama` builtin: a small Llama-style causal LM in plain torch, on graphrun's KV cache.

RMSNorm, rotary position embeddings, grouped-query attention (kv_heads <= heads), a SwiGLU
MLP, an untied LM head; weights from models/seeded.py's seeded init, so the same arguments give
the same model on any device. Its attention goes through kv_cache.attend like a transformers
model's does, so generation (prefill, decode, capture) runs without transformers installed.

forward(tokens [b, q] int64, positions [b, q] int64, kv: StepKV) -> logits [b, V] float32 of
the last column: the step interface of steps.StepModel.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from graphrun.models.builtin.seeded import DEFAULT_RULES, Constant, Init, materialise, on_meta, std

from graphrun.generate.kv_cache import KVLayout, StepKV, attend

WEIGHT_STD = 0.02  # projections' scale; the embedding keeps unit variance (PyTorch's)
ROPE_THETA = 10000.0
NORM_EPS = 1e-5


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, the half-split convention of Llama: x [b, h, q, d]; cos, sin [b, 1, q, d]."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int, kv_heads: int, layer: int):
        super().__init__()
        self.heads, self.kv_heads, self.layer = heads, kv_heads, layer
        self.head_dim = d_model // heads
        self.q_proj = nn.Linear(d_model, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: StepKV) -> torch.Tensor:
        b, q_len, _ = x.shape  # x: [b, q, d_model]
        q = self.q_proj(x).view(b, q_len, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # [b, heads | kv_heads, q, head_dim]
        y = attend(kv, self.layer, q, k, v, self.head_dim ** -0.5)  # [b, q, heads, head_dim]
        return self.o_proj(y.reshape(b, q_len, -1))


class Block(nn.Module):
    """Pre-norm block: attention, then SwiGLU, each residual."""

    def __init__(self, d_model: int, heads: int, kv_heads: int, ffn: int, layer: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d_model, eps=NORM_EPS)
        self.attn = Attention(d_model, heads, kv_heads, layer)
        self.mlp_norm = nn.RMSNorm(d_model, eps=NORM_EPS)
        self.gate = nn.Linear(d_model, ffn, bias=False)
        self.up = nn.Linear(d_model, ffn, bias=False)
        self.down = nn.Linear(ffn, d_model, bias=False)

    def forward(self, x, cos, sin, kv: StepKV) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, kv)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Built on the meta device by build_llama; make_scratch once the weights have values."""

    def __init__(self, layers: int, d_model: int, heads: int, kv_heads: int, vocab: int,
                 max_len: int, ffn: int):
        super().__init__()
        self.vocab, self.max_len = vocab, max_len
        self.layout = KVLayout(layers, heads, kv_heads, d_model // heads)
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, kv_heads, ffn, i)
                                    for i in range(layers))
        self.norm = nn.RMSNorm(d_model, eps=NORM_EPS)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("inv_freq", None, persistent=False)  # [head_dim / 2] float32
        self.register_load_state_dict_post_hook(lambda module, _keys: module.make_scratch())

    @torch.no_grad()
    def make_scratch(self) -> None:
        """RoPE's frequencies, made where the weights are (None while they are on meta)."""
        weight = self.lm_head.weight
        if weight.is_meta:
            return
        d = self.layout.head_dim
        exponent = torch.arange(0, d, 2, dtype=torch.float32, device=weight.device) / d
        self.inv_freq = 1.0 / (ROPE_THETA ** exponent)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                kv: StepKV) -> torch.Tensor:
        # tokens, positions: [b, q] -> logits [b, V] float32 of the last column
        x = self.embed(tokens)  # [b, q, d_model]
        # cos, sin: [b, 1, q, head_dim], computed in float32 then cast, as Llama does
        freqs = positions[..., None].float() * self.inv_freq  # [b, q, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, kv)
        return self.lm_head(self.norm(x[:, -1])).float()


def _linear(module: nn.Module, name: str) -> Init:
    return std(WEIGHT_STD) if name == "weight" else Constant(0.0)


RULES = DEFAULT_RULES | {nn.Linear: _linear}


def build_llama(layers: int = 2, d_model: int = 64, heads: int = 4, kv_heads: int | None = None,
                vocab: int = 512, max_len: int = 512, ffn: int | None = None, seed: int = 0,
                device=None, dtype: torch.dtype | None = None) -> Llama:
    """The same arguments give the same weights on any device (models/seeded.py). kv_heads
    defaults to heads (no GQA); ffn to 8/3 d_model rounded up to 16, as Llama sizes it.
    max_len is the longest prompt + completion the model is meant for (RoPE needs no table,
    so it only documents the limit the generator checks)."""
    kv_heads = kv_heads or heads
    if d_model % heads or heads % kv_heads:
        raise ValueError(f"llama: d_model ({d_model}) must be divisible by heads ({heads}) and "
                         f"heads by kv_heads ({kv_heads})")
    if (d_model // heads) % 2:
        raise ValueError(f"llama: head_dim d_model / heads ({d_model // heads}) must be even "
                         "for rotary embeddings")
    ffn = ffn or -(-(8 * d_model // 3) // 16) * 16
    with on_meta():
        model = Llama(layers, d_model, heads, kv_heads, vocab, max_len, ffn)
    materialise(model, seed, device, dtype, RULES)
    model.make_scratch()
    return model.eval()
