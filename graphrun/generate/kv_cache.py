"""The KV cache graphrun owns for generation, and the attention that writes and reads it.

One k and one v buffer per layer, `[rows, kv_heads, max_len, head_dim]`, allocated once at the
largest batch bucket and the largest KV length, in the model's dtype, on its device. Every graph
(prefill and decode, any bucket) reads and writes these same buffers, sliced as `[:b, :, :L]`,
so a batch may move from one decode graph to a longer one between steps.

A step's attention is described by a StepKV: the rows and the KV length it attends over, the
mask of visible keys (computed once per step from per-row start and write columns, shared by
every layer) and where its new keys go. Prefill writes columns [0, P) of every row; decode writes
one column per row, `write_col[row]`, data in a static device tensor, so rows at different
positions (continuous batching, later) need no new graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn import functional as F

from graphrun.generate.decode_attention import decode_attend, give_up, usable


@dataclass(frozen=True)
class KVLayout:
    """What a model's attention keeps per token: enough to size the cache."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int


class KVCache:
    """Static per-layer k/v buffers. Zeros at first: a column no step wrote is finite, so a
    masked key (weight exactly 0) adds 0 * value = 0, never NaN, to the attention output."""

    def __init__(self, layout: KVLayout, rows: int, max_len: int, dtype: torch.dtype,
                 device: torch.device):
        self.layout, self.rows, self.max_len = layout, rows, max_len
        shape = (rows, layout.kv_heads, max_len, layout.head_dim)
        # k[layer], v[layer]: [rows, kv_heads, max_len, head_dim]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @staticmethod
    def bytes_for(layout: KVLayout, rows: int, max_len: int, dtype: torch.dtype) -> int:
        per = rows * layout.kv_heads * max_len * layout.head_dim
        return 2 * layout.layers * per * torch.empty((), dtype=dtype).element_size()


@dataclass
class StepKV:
    """One step's view of the cache, passed to every layer's attention."""

    cache: KVCache
    rows: int  # b: rows of this step's graph
    length: int  # L: keys attended, cache columns [0, L)
    mask: torch.Tensor  # [b, 1, q_len, L] bool, True where a query sees a key
    write_col: torch.Tensor | None  # [b] int64: decode's one new column per row; None: prefill


def attend(kv: StepKV, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           scaling: float | None) -> torch.Tensor:
    """Write this step's k/v into the cache, then attend over its first L columns.

    q: [b, heads, q_len, head_dim]; k, v: [b, kv_heads, q_len, head_dim], RoPE applied.
    Returns [b, q_len, heads, head_dim] (the layout transformers' attention functions return).
    Under torch.compile it is one operator (graphrun::attend): the model traces around it as
    one graph, the cache writes declared, never looked inside (model.compile,
    generate/compiled.py). Run eagerly it is a plain call: an operator's first call imports
    torch's compiler, seconds of a job's set-up.
    """
    call = torch.ops.graphrun.attend if torch.compiler.is_compiling() else _attend
    return call(kv.cache.k[layer], kv.cache.v[layer], q, k, v, kv.mask, kv.write_col, scaling)


def _attend(cache_k: torch.Tensor, cache_v: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, mask: torch.Tensor, write_col: Optional[torch.Tensor],
            scaling: Optional[float]) -> torch.Tensor:
    """cache_k, cache_v: one layer's whole buffers; mask [b, 1, q_len, L] says b and L."""
    b = q.shape[0]
    if write_col is not None and usable(q):  # decode: the write and the attention, one kernel
        try:
            return decode_attend(cache_k[:b], cache_v[:b], q, k, v, mask, write_col, scaling)
        except Exception as err:  # noqa: BLE001 - a kernel that cannot run: the general path
            give_up(err)
    return general_attend(cache_k, cache_v, q, k, v, mask, write_col, scaling)


def general_attend(cache_k: torch.Tensor, cache_v: torch.Tensor, q: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   write_col: Optional[torch.Tensor], scaling: Optional[float]) -> torch.Tensor:
    """The cache written with torch's indexing, then scaled_dot_product_attention: any step,
    any device."""
    b, heads, q_len, head_dim = q.shape
    kv_heads, length = k.shape[1], mask.shape[-1]
    cache_k, cache_v = cache_k[:b], cache_v[:b]
    if write_col is None:  # prefill: the prompt's columns, the same for every row
        cache_k[:, :, :q_len].copy_(k)
        cache_v[:, :, :q_len].copy_(v)
    else:  # decode: one column per row, at the row's own position
        at = write_col.view(b, 1, 1, 1).expand(b, kv_heads, 1, head_dim)
        cache_k.scatter_(2, at, k.to(cache_k.dtype))
        cache_v.scatter_(2, at, v.to(cache_v.dtype))
    keys, values = cache_k[:, :, :length], cache_v[:, :, :length]  # [b, kv_heads, L, d]
    # GQA without repeating the cache: the query heads sharing a kv head become extra query
    # rows of it (transformers' repeat_kv puts head h at kv head h // groups).
    groups = heads // kv_heads
    q = q.reshape(b, kv_heads, groups * q_len, head_dim)
    mask = mask[:, :, None].expand(b, 1, groups, q_len, length)
    mask = mask.reshape(b, 1, groups * q_len, length)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    # out: [b, kv_heads, groups * q_len, d] -> [b, q_len, heads, d], contiguous as the fake's
    return out.reshape(b, heads, q_len, head_dim).transpose(1, 2).contiguous()


_attend_op = torch.library.custom_op("graphrun::attend", _attend,
                                     mutates_args=("cache_k", "cache_v"))


@_attend_op.register_fake
def _attend_shape(cache_k, cache_v, q, k, v, mask, write_col, scaling):
    b, heads, q_len, head_dim = q.shape
    return q.new_empty((b, q_len, heads, head_dim))
