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


class Attention(nn.Module):
    """Causal self-attention for one new token per row, over max_len cached keys."""

    def __init__(self, d_model: int, heads: int, max_len: int, max_batch: int, device=None):
        super().__init__()
        self.heads = heads
        self.head_dim = d_model // heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        # The prompt every row continues from: part of the model, so saved with the weights.
        ctx = (heads, max_len, self.head_dim)
        self.register_buffer("ctx_k", 0.5 * torch.randn(ctx))
        self.register_buffer("ctx_v", 0.5 * torch.randn(ctx))
        # Between steps every cache row holds the context (forward relies on it); scratch
        # state, so not in the state dict, and refilled whenever the context is loaded. Made on
        # `device` (where the model will run): filled from the context, not drawn at random.
        cache = (max_batch, heads, max_len, self.head_dim)
        self.register_buffer("cache_k", torch.empty(cache, device=device), persistent=False)
        self.register_buffer("cache_v", torch.empty(cache, device=device), persistent=False)
        self.refill_cache()
        self.register_load_state_dict_post_hook(_refill_after_load)

    @torch.no_grad()
    def refill_cache(self) -> None:
        # the context moved once, then expanded where the cache is
        self.cache_k.copy_(self.ctx_k.to(self.cache_k.device).expand_as(self.cache_k))
        self.cache_v.copy_(self.ctx_v.to(self.cache_v.device).expand_as(self.cache_v))

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


def _refill_after_load(attn: Attention, _incompatible_keys) -> None:
    attn.refill_cache()  # the loaded context replaces the one the cache was filled with


class Block(nn.Module):
    """Pre-LN transformer block: attention, then a 4x GELU MLP, each residual."""

    def __init__(self, d_model: int, heads: int, max_len: int, max_batch: int, device=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads, max_len, max_batch, device)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        # x: [B, 1, d_model]
        x = x + self.attn(self.norm1(x), positions, visible)
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self, layers: int, d_model: int, heads: int, vocab: int, max_len: int,
                 max_batch: int, device=None):
        super().__init__()
        self.max_len = max_len
        self.max_batch = max_batch
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, heads, max_len, max_batch, device) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        # Separate from tok_emb: tied tensors cannot be saved with safetensors.save_file.
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        # Key positions 0..max_len-1, a buffer so forward creates no host tensor.
        self.register_buffer("key_pos", torch.arange(max_len), persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

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


def build_decoder(layers: int = 2, d_model: int = 64, heads: int = 4, vocab: int = 512,
                  max_len: int = 128, max_batch: int = 32, seed: int = 0,
                  device=None) -> Decoder:
    """The same arguments give the same weights and context; the global RNG is left as it was.

    max_batch sizes the KV cache; graphrun passes the largest batch bucket. device: where the
    KV cache (max_batch x max_len per layer, the bulk of the memory) is made; the weights are
    drawn on the CPU, whose seeded generator gives the same values everywhere.
    """
    if d_model % heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Decoder(layers, d_model, heads, vocab, max_len, max_batch, device)
