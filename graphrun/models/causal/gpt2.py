"""graphrun's GPT-2: a Hugging Face GPT-2 folder saved as safetensors, on graphrun's KV cache,
without transformers.

Parameters carry transformers' names (transformer.h.0.attn.c_attn.weight, ...), Conv1D weights
stored [in, out] as GPT-2 saves them and applied as transformers applies them (addmm), learned
positions, LayerNorm, the tanh GELU; the LM head is the token embedding, tied. The step
interface is steps.StepModel's, as the Llama's (models/causal/llama.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from graphrun.models.checkpoint import GPT2Shape

from graphrun.models.causal.kv_cache import KVLayout, StepKV, attend


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELUActivation, term by term (torch's tanh GELU rounds otherwise)."""
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
    return 0.5 * x * (1.0 + torch.tanh(inner))


ACTIVATIONS = {"gelu_new": gelu_new,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "gelu": F.gelu, "relu": F.relu}


class Conv1D(nn.Module):
    """GPT-2's projection: weight [in, out], y = bias + x @ weight."""

    def __init__(self, width_in: int, width_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width_in, width_out))
        self.bias = nn.Parameter(torch.empty(width_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(*x.shape[:-1], self.weight.shape[1])


class Attention(nn.Module):
    def __init__(self, s: GPT2Shape, layer: int):
        super().__init__()
        self.heads, self.head_dim, self.layer = s.heads, s.head_dim, layer
        self.scaling = s.head_dim ** -0.5 if s.scale else 1.0
        self.c_attn = Conv1D(s.d_model, 3 * s.d_model)
        self.c_proj = Conv1D(s.d_model, s.d_model)

    def forward(self, x: torch.Tensor, kv: StepKV) -> torch.Tensor:
        b, q_len, d = x.shape  # x: [b, q, d_model]
        q, k, v = (t.view(b, q_len, self.heads, self.head_dim).transpose(1, 2)
                   for t in self.c_attn(x).split(d, dim=2))
        y = attend(kv, self.layer, q, k, v, self.scaling)  # [b, q, heads, head_dim]
        return self.c_proj(y.reshape(b, q_len, d))


class MLP(nn.Module):
    def __init__(self, s: GPT2Shape):
        super().__init__()
        self.c_fc = Conv1D(s.d_model, s.ffn)
        self.c_proj = Conv1D(s.ffn, s.d_model)
        self.act = ACTIVATIONS[s.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, s: GPT2Shape, layer: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(s.d_model, eps=s.norm_eps)
        self.attn = Attention(s, layer)
        self.ln_2 = nn.LayerNorm(s.d_model, eps=s.norm_eps)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor, kv: StepKV) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv)
        return x + self.mlp(self.ln_2(x))


class Body(nn.Module):
    def __init__(self, s: GPT2Shape):
        super().__init__()
        self.wte = nn.Embedding(s.vocab, s.d_model)
        self.wpe = nn.Embedding(s.max_len, s.d_model)
        self.h = nn.ModuleList(Block(s, i) for i in range(s.layers))
        self.ln_f = nn.LayerNorm(s.d_model, eps=s.norm_eps)


class GPT2(nn.Module):
    """Built on the meta device by generate/llama.load_checkpoint; eos_ids and pad_id: the
    checkpoint's own (its config files)."""

    def __init__(self, shape: GPT2Shape):
        super().__init__()
        self.shape, self.vocab, self.max_len = shape, shape.vocab, shape.max_len
        self.layout = KVLayout(shape.layers, shape.heads, shape.heads, shape.head_dim)
        self.eos_ids: tuple[int, ...] | None = None
        self.pad_id: int | None = None
        self.transformer = Body(shape)
        self.lm_head = nn.Linear(shape.d_model, shape.vocab, bias=False)
        if shape.tied:
            self.lm_head.weight = self.transformer.wte.weight

    def make_scratch(self) -> None:
        """Nothing to remake after a cast: positions are a learned table."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                kv: StepKV) -> torch.Tensor:
        # tokens, positions: [b, q] -> logits [b or n, V] in the weights' dtype
        # (StepKV.last_hidden); the step casts them into its float32 buffer
        t = self.transformer
        x = t.wte(tokens) + t.wpe(positions)  # [b, q, d_model]
        for block in t.h:
            x = block(x, kv)
        return self.lm_head(t.ln_f(kv.last_hidden(x)))
