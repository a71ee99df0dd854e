"""The `mlp` builtin: a scoring MLP, the smallest model that is still launch-bound.

x [B, in_features] -> scores [B, out_features]. Every op is per row, so padded rows can never
change real rows.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from graphrun.models.builtin.seeded import materialise, on_meta


class Block(nn.Module):
    """Pre-LN residual block: h + GELU(Linear(LN(h)))."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # h: [B, hidden]
        return h + F.gelu(self.fc(self.norm(h)))


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, layers: int, out_features: int):
        super().__init__()
        self.in_features = in_features
        self.inp = nn.Linear(in_features, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, in_features] -> [B, out_features]
        if x.shape[-1] != self.in_features:
            raise ValueError(f"mlp expects x of shape [B, {self.in_features}], "
                             f"got {list(x.shape)}")
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(self.norm(h))


def build_mlp(in_features: int = 64, hidden: int = 256, layers: int = 4,
              out_features: int = 16, seed: int = 0, device=None,
              dtype: torch.dtype | None = None) -> MLP:
    """The same arguments give the same weights, on any device (builtin/seeded.py, PyTorch's
    default scales); the global RNG is not used. Made on `device` (default cpu) in `dtype`
    (default float32); on the meta device, without values (weights follow)."""
    with on_meta():
        model = MLP(in_features, hidden, layers, out_features)
    return materialise(model, seed, device, dtype)
