"""The `decoder` builtin: one GPT-style decode step over a static KV cache.

forward(tokens [B, 1] int64, positions [B] int64) -> logits [B, 1, vocab].

Capture-safe: no host syncs, no data-dependent shapes, no tensors created on the host in forward.
Like a real decoder it writes each row's new k/v into its cache row at that row's position (an
in-place mutation of a buffer, which is why torch.compile's reduce-overhead mode skips cudagraphs
on it) and attends over the cache rows [0:B], keys after the position masked. Unlike a real
decoder, a row's result depends only on its own (token, position): between steps every cache row
holds the same fixed, seeded "context" (standing for an already-processed prompt), and each step
puts the context back where it wrote. So a record gives the same logits in any batch row, after
any earlier batch, and padded rows (cache rows >= B are never touched) cannot change real rows.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from graphrun.models.builtin.seeded import DEFAULT_RULES, Constant, Init, materialise, on_meta, std

# The decoder's own scales, not PyTorch's defaults: std 0.02 (GPT-2's) for the weights of
# Linear and Embedding, Linear biases zero.
WEIGHT_STD = 0.02


class Attention(nn.Module):
    """Causal self-attention for one new token per row, over max_len cached keys."""

    def __init__(self, d_model: int, heads: int, max_len: int, max_batch: int):
        super().__init__()
        self.heads = heads
        self.head_dim = d_model // heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        # The prompt every row continues from: part of the model, so saved with the weights.
        ctx = (heads, max_len, self.head_dim)
        self.register_buffer("ctx_k", torch.empty(ctx))
        self.register_buffer("ctx_v", torch.empty(ctx))
        # Between steps every cache row holds the context (forward relies on it); scratch
        # state, so not in the state dict, made by refill_cache once the context has values.
        self.cache_shape = (max_batch, heads, max_len, self.head_dim)
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)

    def seeded_init(self, name: str) -> Init | None:
        # the context's scale: standard deviation 0.5
        return std(0.5) if name in ("ctx_k", "ctx_v") else None

    @torch.no_grad()
    def refill_cache(self) -> None:
        """Every cache row the context, the cache made where the context is, in its dtype."""
        for name, ctx in (("cache_k", self.ctx_k), ("cache_v", self.ctx_v)):
            cache = getattr(self, name)
            if cache is None or cache.device != ctx.device or cache.dtype != ctx.dtype:
                cache = torch.empty(self.cache_shape, dtype=ctx.dtype, device=ctx.device)
                setattr(self, name, cache)
            cache.copy_(ctx.expand_as(cache))

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        # x: [B, 1, d_model]; positions: [B]; visible: [B, max_len] bool, key j <= position
        B, _, d_model = x.shape
        q, k, v = self.qkv(x).view(B, 1, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        # q, k, v: [B, heads, 1, head_dim]. Rows [0:B] only: rows beyond B are never touched.
        at = positions.view(B, 1, 1, 1).expand(B, self.heads, 1, self.head_dim)
        cache_k, cache_v = self.cache_k[:B], self.cache_v[:B]  # [B, heads, max_len, head_dim]
        cache_k.scatter_(2, at, k)
        cache_v.scatter_(2, at, v)
        y = F.scaled_dot_product_attention(q, cache_k, cache_v,
                                           attn_mask=visible[:, None, None, :])
        # Put the context back where the new k/v went, so the next batch finds the same prompt
        # in every row: a record's result never depends on the batches before it.
        cache_k.scatter_(2, at, self._context_at(self.ctx_k, positions))
        cache_v.scatter_(2, at, self._context_at(self.ctx_v, positions))
        return self.proj(y.transpose(1, 2).reshape(B, 1, d_model))

    @staticmethod
    def _context_at(ctx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # ctx: [heads, max_len, head_dim] -> [B, heads, 1, head_dim] at each row's position
        return ctx[:, positions].transpose(0, 1).unsqueeze(2)


class Block(nn.Module):
    """Pre-LN transformer block: attention, then a 4x GELU MLP, each residual."""

    def __init__(self, d_model: int, heads: int, max_len: int, max_batch: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads, max_len, max_batch)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        # x: [B, 1, d_model]
        x = x + self.attn(self.norm1(x), positions, visible)
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class Decoder(nn.Module):
    """Built on the meta device by build_decoder; make_scratch once the weights have values."""

    def __init__(self, layers: int, d_model: int, heads: int, vocab: int, max_len: int,
                 max_batch: int):
        super().__init__()
        self.max_len = max_len
        self.max_batch = max_batch
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, heads, max_len, max_batch) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        # Separate from tok_emb: tied tensors cannot be saved with safetensors.save_file.
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        # Key positions 0..max_len-1, a buffer so forward creates no host tensor.
        self.register_buffer("key_pos", None, persistent=False)
        self.register_load_state_dict_post_hook(_scratch_after_load)

    @torch.no_grad()
    def make_scratch(self) -> None:
        """The non-persistent buffers, made where the weights are: key positions, KV caches.
        None while the weights are on the meta device (a meta arange imports torch._dynamo)."""
        if self.lm_head.weight.is_meta:
            return
        self.key_pos = torch.arange(self.max_len, device=self.lm_head.weight.device)
        for block in self.blocks:
            block.attn.refill_cache()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # tokens: [B, 1] int64; positions: [B] int64, each < max_len -> logits [B, 1, vocab]
        B = tokens.shape[0]
        if B > self.max_batch:
            raise ValueError(f"decoder batch of {B} rows exceeds its KV cache "
                             f"(max_batch={self.max_batch})")
        x = self.tok_emb(tokens) + self.pos_emb(positions)[:, None, :]  # [B, 1, d_model]
        visible = self.key_pos[None, :] <= positions[:, None]  # [B, max_len]
        for block in self.blocks:
            x = block(x, positions, visible)
        return self.lm_head(self.norm(x))


def _scratch_after_load(decoder: Decoder, _incompatible_keys) -> None:
    decoder.make_scratch()  # from the loaded context, where the loaded weights are


def _linear(module: nn.Module, name: str) -> Init:
    return std(WEIGHT_STD) if name == "weight" else Constant(0.0)


RULES = DEFAULT_RULES | {nn.Linear: _linear, nn.Embedding: lambda m, name: std(WEIGHT_STD)}


def build_decoder(layers: int = 2, d_model: int = 64, heads: int = 4, vocab: int = 512,
                  max_len: int = 128, max_batch: int = 32, seed: int = 0,
                  device=None, dtype: torch.dtype | None = None) -> Decoder:
    """The same arguments give the same weights and context, on any device (builtin/seeded.py);
    the global RNG is not used.

    max_batch sizes the KV cache; graphrun passes the largest batch bucket. The model is made
    on `device` (default cpu) in `dtype` (default float32), KV cache included. On the meta
    device nothing is made: load a state dict with assign=True, which makes the scratch.
    """
    if d_model % heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
    with on_meta():
        model = Decoder(layers, d_model, heads, vocab, max_len, max_batch)
    materialise(model, seed, device, dtype, RULES)
    model.make_scratch()
    return model
