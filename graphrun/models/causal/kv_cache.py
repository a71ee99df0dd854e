"""The KV cache graphrun owns for generation, in blocks (paged), and the attention on it.

One k and one v buffer per layer, `[num_blocks, kv_heads, block_size, head_dim]`, allocated once
in the model's dtype on its device. A row's tokens live in the blocks its block table names, in
order (models/causal/paged_attention.py). Block 0 belongs to no row: padded prefill tokens and
empty decode slots write there, and nobody reads what they wrote. The host hands blocks out
and takes them back (BlockPool); the graphs only read the tables.

A step's attention is described by a StepKV, shared by every layer:
- prefill: the admitted prompts packed into one sequence of T tokens (tokens [1, T]); each
  token sees the earlier tokens of its own prompt (`starts`, the prompts' boundaries, for the
  flash kernel; `segment` and `positions` [T], from which `mask` [1, 1, T, T] is built where
  it does not run: models/causal/packed_attention.py), attention runs over the step's fresh
  keys, then they are written at `slots` [T] (flat block * block_size + offset); `last` [n]
  says which tokens' logits the step needs (each prompt's last). A
  prompt whose leading blocks are cached (BlockPool) packs only its other tokens, at their
  positions; its tokens also see those blocks' keys, gathered (`prefix` [P] blocks, `prefix_mask`
  [1, 1, T, P * block_size], P the blocks the step reads: none in a captured prefill), as if
  they were the first of its own.
- decode: one token per row, written at seq_lens - 1 and attended over the row's first seq_lens
  keys through its block table (paged_decode; RoPE inside it for graphrun's Llama:
  attend_rotary).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

import torch

from graphrun.models.causal import fused, packed_attention, paged_attention
from graphrun.models.causal.paged_attention import (attention, gather_blocks, paged_decode,
                                                    paged_decode_reference, write_prefill)

TRASH_BLOCK = 0  # written by padding, read by nobody


@dataclass(frozen=True)
class KVLayout:
    """What a model's attention keeps per token: enough to size the cache."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int


class PagedCache:
    """Static per-layer k/v block buffers. Zeros at first, so a key no step wrote is finite."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.layout, self.num_blocks, self.block_size = layout, num_blocks, block_size
        shape = (num_blocks, layout.kv_heads, block_size, layout.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @staticmethod
    def bytes_per_block(layout: KVLayout, block_size: int, dtype: torch.dtype) -> int:
        per = layout.kv_heads * block_size * layout.head_dim
        return 2 * layout.layers * per * torch.empty((), dtype=dtype).element_size()


def chain_hashes(tokens: list[int], block_size: int, count: int) -> list[bytes]:
    """The keys of a prompt's first `count` full blocks: each a hash of its parent's key and
    its own tokens, so a key names every token up to and including its block."""
    keys, parent = [], b""
    ids = np.asarray(tokens[:count * block_size], dtype=np.int64)
    for j in range(count):
        parent = hashlib.blake2b(parent + ids[j * block_size:(j + 1) * block_size].tobytes(),
                                 digest_size=16).digest()
        keys.append(parent)
    return keys


class BlockPool:
    """The host's ledger of blocks (block 0 never handed out). A row takes blocks as it grows
    and gives them all back when it finishes; the lowest free blocks go first.

    Prefix caching: a full prompt block can be registered under its chain hash; a later
    prompt whose leading blocks have those keys shares them (a reference each) instead of
    computing them. A registered block no row holds stays cached, idle, and is the first to
    be taken, least recently used first, once no never-registered block is free: `free`
    counts both, so a block a row holds (shared) is never taken from under it."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"a block pool needs 2 blocks at least (block 0 is the trash "
                             f"block), not {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, TRASH_BLOCK, -1))  # popped from the end
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # registered block -> its chain hash
        self._block_of: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unheld: LRU first

    @property
    def free(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - self.free

    @property
    def cached(self) -> int:
        """Registered blocks, held or idle."""
        return len(self._key_of)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def take(self, count: int) -> list[int]:
        if count > self.free:
            raise RuntimeError(f"{count} blocks asked, {self.free} free")
        fresh = min(count, len(self._free))
        taken = self._free[len(self._free) - fresh:][::-1]
        del self._free[len(self._free) - fresh:]
        for _ in range(count - fresh):  # evicted: its key names it no more
            block, _ = self._idle.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            taken.append(block)
        for block in taken:
            self._refs[block] = 1
        return taken

    def give(self, blocks: list[int]) -> None:
        # a row's last blocks first: the deepest of a chain becomes idle, so evicted, first
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)
        self._free.sort(reverse=True)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the leading keys, up to the first not cached."""
        found = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def idle_among(self, blocks: list[int]) -> int:
        """How many of these cached blocks no row holds (sharing them takes them from free)."""
        return sum(1 for b in blocks if not self._refs[b])

    def share(self, blocks: list[int]) -> None:
        """A reference to each of these cached blocks; an idle one is no longer evictable."""
        for block in blocks:
            self._refs[block] += 1
            self._idle.pop(block, None)

    def register(self, block: int, key: bytes) -> bool:
        """Name a held block's full prompt tokens by their chain hash; False (nothing done)
        when that key already names a block."""
        if key in self._block_of:
            return False
        self._block_of[key], self._key_of[block] = block, key
        return True


@dataclass
class StepKV:
    """One step's view of the cache, passed to every layer's attention (see the module's
    docstring). Prefill: segment, positions, starts, slots, last; decode: block_table,
    seq_lens."""

    cache: PagedCache
    segment: torch.Tensor | None = None  # prefill [T] int64: each token's prompt; -1 padding
    positions: torch.Tensor | None = None  # prefill [T] int64: each token's place in it
    starts: torch.Tensor | None = None  # prefill [n + 2] int32 (packed_attention.py)
    slots: torch.Tensor | None = None  # prefill [T] int64
    last: torch.Tensor | None = None  # prefill [n] int64: the tokens whose logits are needed
    prefix: torch.Tensor | None = None  # prefill [P] int64: cached blocks read; 0: none
    prefix_mask: torch.Tensor | None = None  # prefill [1, 1, T, P * block_size] bool
    block_table: torch.Tensor | None = None  # decode [b, max_blocks] int32
    seq_lens: torch.Tensor | None = None  # decode [b] int32, the new key included
    _mask: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def prefill(self) -> bool:
        return self.slots is not None

    @property
    def mask(self) -> torch.Tensor:
        """Prefill [1, 1, T, T] bool, True where a query sees a key: the earlier tokens of its
        own prompt (padding sees padding at least); built once a step, where a layer needs it
        (not a functools.cached_property: its lock stops torch.compile)."""
        if self._mask is None:
            segment, positions = self.segment, self.positions
            sees = ((segment[None, :] == segment[:, None])
                    & (positions[None, :] <= positions[:, None]))
            self._mask = sees[None, None]
        return self._mask

    def last_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, q, d] -> the hidden states whose logits the step needs: decode's one column
        [b, d]; prefill's prompts' last tokens [n, d]."""
        return x[0, self.last] if self.prefill else x[:, -1]


def attend(kv: StepKV, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           scaling: float | None, softcap: float | None = None,
           window: int | None = None) -> torch.Tensor:
    """q: [b, heads, q_len, head_dim]; k, v: [b, kv_heads, q_len, head_dim], RoPE applied.
    Returns [b, q_len, heads, head_dim] (the layout transformers' attention functions return).
    softcap: the scores capped as softcap * tanh(score / softcap) (Gemma2); window: a query
    sees only the keys less than `window` positions before it (sliding-window layers)."""
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    k_cache, v_cache = kv.cache.k[layer], kv.cache.v[layer]
    if not kv.prefill:
        if window is not None and window >= kv.block_table.shape[1] * kv.cache.block_size:
            window = None  # it covers every key a row can hold
        if softcap is not None or window is not None:  # not in the kernel: the reference
            return paged_decode_reference(q, k, v, k_cache, v_cache, kv.block_table,
                                          kv.seq_lens, scale, softcap, window)
        return paged_decode(q, k, v, k_cache, v_cache, kv.block_table, kv.seq_lens, scale)
    out = None
    if kv.prefix is None and packed_attention.runs(q, softcap):
        try:
            out = packed_attention.attend(q, k, v, kv.starts, scale, window)
        except Exception as err:  # noqa: BLE001 - a kernel that cannot run: the masked one
            packed_attention.give_up(err)
    if out is None:
        out = masked_prefill(kv, k_cache, v_cache, q, k, v, scale, softcap, window)
    # k, v [1, kv_heads, T, d] -> [T, kv_heads, d]
    write_prefill(k[0].transpose(0, 1), v[0].transpose(0, 1), k_cache, v_cache, kv.slots)
    return out


def attend_rotary(kv: StepKV, layer: int, qk: torch.Tensor, heads: int, v: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, scaling: float,
                  window: int | None = None, kernels: bool = True) -> torch.Tensor:
    """attend for a model whose q and k still need Llama's RoPE: qk [b, q, heads + kv_heads, d]
    (q's heads, then k's), cos, sin [b, 1, q, d]. A decode step's paged kernel applies RoPE as
    it loads q and the new key (paged_attention.takes_rotary), one kernel a layer fewer;
    elsewhere fused.rope first (kernels: its Triton kernel where it runs), then attend. The
    values are the same either way."""
    q = qk.transpose(1, 2)  # [b, heads + kv_heads, q, d]
    if (kernels and not kv.prefill and paged_attention.takes_rotary(q, cos)
            and (window is None or window >= kv.block_table.shape[1] * kv.cache.block_size)):
        return paged_decode(q[:, :heads], q[:, heads:], v, kv.cache.k[layer], kv.cache.v[layer],
                            kv.block_table, kv.seq_lens, scaling, rotary=(cos, sin))
    q, k = fused.rope(qk, cos, sin, kernels).split([heads, qk.shape[2] - heads], dim=1)
    return attend(kv, layer, q, k, v, scaling, window=window)


def masked_prefill(kv: StepKV, k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None,
                   window: int | None) -> torch.Tensor:
    """The prefill's attention as a dense one under StepKV.mask, over the cached prefixes'
    keys too where the step reads some."""
    mask = kv.mask
    if window is not None and window < mask.shape[-1]:
        # a prompt's tokens are packed in order: the distance of two of them is their
        # positions' distance (the engine keeps the prefix cache off under a window)
        at = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (at[:, None] - at[None, :] < window)
    if kv.prefix is not None:  # the cached prefixes' keys first, then the step's own
        k = torch.cat((gather_blocks(k_cache, kv.prefix)[None].to(k.dtype), k), dim=2)
        v = torch.cat((gather_blocks(v_cache, kv.prefix)[None].to(v.dtype), v), dim=2)
        mask = torch.cat((kv.prefix_mask, mask), dim=-1)
    return fresh_attend(q, k, v, mask, scale, softcap)


def fresh_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float, softcap: float | None = None) -> torch.Tensor:
    """Attention over the keys given: q [b, heads, q, d], k, v [b, kv_heads, n, d], mask
    [b, 1, q, n] -> [b, q, heads, d]. GQA without repeating the keys: the query heads sharing a
    kv head become extra query rows of it (transformers' repeat_kv puts head h at kv head
    h // groups)."""
    b, heads, q_len, head_dim = q.shape
    kv_heads, n = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    q = q.reshape(b, kv_heads, groups * q_len, head_dim)
    mask = mask[:, :, None].expand(b, 1, groups, q_len, n).reshape(b, 1, groups * q_len, n)
    out = attention(q, k.to(q.dtype), v.to(q.dtype), mask, scale, softcap)
    return out.reshape(b, heads, q_len, head_dim).transpose(1, 2).contiguous()
