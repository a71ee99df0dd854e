"""Decode attention as one pass over the cache: the step's new key and value written into their
column and every query head of a KV head attended over the first L columns, in Triton.

A decode step's attention per layer is tiny (one query per row) and the general path spends more
in launches than in work: the cache writes (a scatter for k, one for v), the boolean mask made
into the form the fused attention takes, the attention kernel. Here it is one kernel, or two
where one row's columns are split across programs to fill the GPU (flash-decoding): each
program takes a share of the columns of one (row, KV head), all the query heads sharing that KV
head at once (grouped-query attention without repeating the cache), and keeps a running
softmax; a second kernel merges the shares. The new column is read from the step's k and v
themselves, not back from the cache, so the programs that read the column need not wait for
the one that writes it.

Used where it can run: Triton importable, the tensors on a GPU (or Triton's interpreter on the
CPU, TRITON_INTERPRET=1, for tests), one query per row, a head_dim of at most 256. Elsewhere
kv_cache._attend takes the general path (scatter, then scaled_dot_product_attention), and so it
does for the rest of the process once the kernel has failed (give_up; the graph table names the
failure in the manifest once).
"""

from __future__ import annotations

import functools
import os

import torch

from graphrun.base.errors import first_line

MAX_SPLITS = 16  # shares of one row's columns at most; the merge kernel reads them at once
PROGRAMS = 128  # split a row's columns until (rows x KV heads x shares) reaches about this


@functools.lru_cache(maxsize=1)
def _kernels():
    """(split kernel, merge kernel), or None without Triton; imported on first use so a job
    that never decodes on a GPU never imports Triton."""
    try:
        from graphrun.generate import decode_kernels
    except ImportError:
        return None
    return decode_kernels.split, decode_kernels.merge


_failures: list[str] = []  # why the kernel failed in this process: it is not tried again


def usable(q: torch.Tensor) -> bool:
    """Whether this kernel can run the attention of q [b, heads, q_len, head_dim]."""
    return runs_on(q.device, q.dtype, q.shape[3], q_len=q.shape[2])


def runs_on(device: torch.device, dtype: torch.dtype, head_dim: int, q_len: int = 1) -> bool:
    """Whether a decode step's attention on this device, in this dtype, runs this kernel (the
    manifest's generation.decode_attention)."""
    device = torch.device(device)
    on = device.type == "cuda" or (device.type == "cpu"
                                   and os.environ.get("TRITON_INTERPRET") == "1")
    return (on and not _failures and q_len == 1 and head_dim <= 256
            and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and _kernels() is not None)


def give_up(err: BaseException) -> None:
    """The kernel failed (a GPU or a Triton it cannot compile for): the general path from now
    on. Its first call is an eager step before any capture, so nothing was launched."""
    _failures.append(first_line(err))


def failure() -> str | None:
    """Why the kernel is no longer used in this process, or None."""
    return _failures[0] if _failures else None


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def decode_attend(cache_k: torch.Tensor, cache_v: torch.Tensor, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  write_col: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """cache_k, cache_v: [b, kv_heads, max_len, d] (the step's rows); q [b, heads, 1, d];
    k, v [b, kv_heads, 1, d]; mask [b, 1, 1, L] bool; write_col [b] int64.
    Writes k, v at write_col, returns [b, 1, heads, d] (kv_cache.attend's layout)."""
    split, merge = _kernels()
    assert cache_k.stride() == cache_v.stride(), "k and v caches of one layout"
    b, heads, _, dim = q.shape
    kv_heads, length = k.shape[1], mask.shape[-1]
    groups = heads // kv_heads
    # tensor-core products need 16 rows and 16 columns at least: query heads past the group's
    # are zero rows, columns past head_dim zero columns
    bg, bd, bn = max(16, _pow2(groups)), max(16, _pow2(dim)), 32
    shares = min(MAX_SPLITS, -(-length // bn), max(1, -(-PROGRAMS // (b * kv_heads))))
    chunk = -(-(-(-length // shares)) // bn) * bn  # columns per share, whole blocks
    shares = -(-length // chunk)
    out = torch.empty((b, 1, heads, dim), dtype=q.dtype, device=q.device)
    # with one share nothing is merged (the same kernel either way: one compilation)
    merged = (b, kv_heads, shares) if shares > 1 else (1,)
    part = torch.empty((*merged, bg, bd), dtype=torch.float32, device=q.device)
    stat = torch.empty((*merged, 2, bg), dtype=torch.float32, device=q.device)
    seen = mask.view(torch.uint8)  # [b, 1, 1, L]: its strides say where each row's keys are
    warps = 4
    split[(b, kv_heads, shares)](
        q, k, v, cache_k, cache_v, seen, write_col, out, part, stat,
        dim ** -0.5 if scaling is None else scaling, length, chunk,
        q.stride(0), q.stride(1), q.stride(3), k.stride(0), k.stride(1), k.stride(3),
        v.stride(0), v.stride(1), v.stride(3),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), cache_k.stride(3),
        seen.stride(0), seen.stride(3),
        G=groups, BG=bg, D=dim, BD=bd, BN=bn,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps)
    if shares > 1:
        merge[(b, kv_heads)](out, part, stat, shares, G=groups, BG=_pow2(groups), PG=bg,
                             D=dim, BD=bd, BS=MAX_SPLITS, num_warps=warps)
    return out
