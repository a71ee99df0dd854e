"""A small encoder for a `target:` pipeline over variable-length token records.

    model:
      target: "models/tiny_encoder.py:build"
      args: {vocab: 1000, d_model: 64}

forward(tokens [B, S] int64, mask [B, S] bool or int, 1 = real token, 0 = pad)
    -> {"hidden": [B, S, d_model], "pooled": [B, out_dim or d_model]}

Records are padded at the end, so a real token keeps its position. Padding cannot change real
rows or positions: attention masks padded keys, pooling averages real tokens only, and padded
positions of `hidden` are zeros.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    """Pre-LN transformer block with a key padding mask."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, keys_visible: torch.Tensor) -> torch.Tensor:
        # x: [B, S, d_model]; keys_visible: [B, 1, 1, S] bool
        B, S, d_model = x.shape
        qkv = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, d_model // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, heads, S, head_dim]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keys_visible)
        x = x + self.proj(y.transpose(1, 2).reshape(B, S, d_model))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class TinyEncoder(nn.Module):
    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, max_len: int,
                 out_dim: int | None):
        super().__init__()
        self.max_len = max_len
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Identity() if out_dim is None else nn.Linear(d_model, out_dim)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        # tokens, mask: [B, S]
        S = tokens.shape[1]
        if S > self.max_len:
            raise ValueError(f"sequence of length {S} is longer than max_len={self.max_len}")
        real = mask != 0  # [B, S]
        x = self.tok_emb(tokens) + self.pos_emb.weight[:S]  # [B, S, d_model]
        # A row with no real token (a padded batch row) attends to everything, so it stays
        # finite instead of a softmax over nothing (NaN).
        keys_visible = real | ~real.any(dim=1, keepdim=True)  # [B, S]
        for block in self.blocks:
            x = block(x, keys_visible[:, None, None, :])
        weight = real.unsqueeze(-1).to(x.dtype)  # [B, S, 1]
        hidden = self.norm(x) * weight
        pooled = hidden.sum(dim=1) / weight.sum(dim=1).clamp(min=1)  # [B, d_model]
        return {"hidden": hidden, "pooled": self.head(pooled)}


def build(vocab: int = 1000, d_model: int = 64, heads: int = 4, layers: int = 2,
          max_len: int = 64, out_dim: int | None = None, seed: int = 0) -> TinyEncoder:
    """The same arguments give the same weights; the global RNG is left as it was.

    out_dim: project the pooled vector to this size; None keeps d_model.
    """
    if d_model % heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyEncoder(vocab, d_model, heads, layers, max_len, out_dim)
