"""Decode attention over a KV cache kept in blocks (paged), and the prefill's write into it.

One layer's cache is `[num_blocks, kv_heads, block_size, head_dim]` for k and the same for v. A
row's tokens live in the blocks its block table names, in order: token t of row r is at block
`block_table[r, t // block_size]`, offset `t % block_size`. A row holds blocks for its actual
length, so how many rows decode at once is bounded by the memory they use.

A decode step's attention per layer is one call, `paged_decode`: the step's new key and value
written at the row's position `seq_lens[r] - 1`, then each query head attends over the row's
first `seq_lens[r]` keys (grouped-query attention without repeating the cache: query head h reads
kv head h // (heads // kv_heads)). On a GPU it is a Triton kernel (models/causal/paged_kernels.py,
split-K flash-decoding): its grid depends only on the number of rows and
the block table's width, never on the lengths, and each program skips the columns past its
row's own length, so one CUDA graph captured for b rows and max_blocks serves every length at a
cost that follows the lengths. Elsewhere, and for the rest of the process once the kernel has
failed (give_up), `paged_decode_reference`: the blocks gathered through the table, then
scaled_dot_product_attention with a per-row length mask; it is also the semantics oracle.

Padded rows (slots with no request) carry seq_lens 1 and a block table pointing at block 0, a
block no request owns: their write lands there and their output is finite, never NaN. Entries of
a block table past a row's length are never read by the kernel; the reference gathers them, so
they must name a block that exists (0 does).

Nothing here syncs with the host or branches on the data: every call can be captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from graphrun.base.triton_switch import KernelSwitch
from graphrun.models.causal.fused import beyond_rounding, rope_eager



@dataclass(frozen=True)
class KernelConfig:
    """How the Triton kernel is launched: tile, warps, pipeline stages and how a row's columns
    split across programs. The defaults are what every step runs; benchmarks/tune_paged_decode.py
    times others on a GPU against them."""

    tile: int = 32  # cache columns one program attends per loop step
    # a launch's warps change the softmax's reduction order, so the outputs' last bits: one
    # launch for every row count keeps a record's tokens independent of its neighbours
    warps: int = 4  # num_warps of the split kernel
    stages: int = 2  # Triton's software pipelining: the next tile loads while this one computes
    merge_warps: int = 4  # num_warps of the merge: it reads every share's [BG, BD] at once
    programs: int = 128  # split a row's columns until (rows x KV heads x shares) reaches this
    max_splits: int = 16  # shares of one row's columns at most; the merge reads them at once

    def __post_init__(self):
        errors = []
        if not (_is_pow2(self.tile) and 16 <= self.tile <= 256):
            # tensor-core products need 16 columns at least; tl.arange, a power of two
            errors.append(f"tile {self.tile}: a power of two from 16 to 256")
        for name in ("warps", "merge_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                errors.append(f"{name} {getattr(self, name)}: 1, 2, 4, 8 or 16")
        if not 1 <= self.stages <= 8:
            errors.append(f"stages {self.stages}: 1 to 8")
        if self.programs < 1:
            errors.append(f"programs {self.programs}: 1 or more")
        if not (_is_pow2(self.max_splits) and self.max_splits <= 64):
            errors.append(f"max_splits {self.max_splits}: a power of two from 1 to 64")
        if errors:
            raise ValueError("paged decode KernelConfig: " + "; ".join(errors))


def _is_pow2(n) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


CONFIG = KernelConfig()  # what paged_decode launches


def paged_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float,
                 rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Write the step's k/v into their block, then attend over each row's first seq_lens keys.

    q [b, heads, 1, d]; k_new, v_new [b, kv_heads, 1, d], RoPE applied; k_cache, v_cache one
    layer's [num_blocks, kv_heads, block_size, d]; block_table [b, max_blocks] int32; seq_lens
    [b] int32, the keys visible including the new one (so at least 1). rotary (cos, sin)
    [b, 1, 1, d]: q and k_new arrive before Llama's RoPE, which the kernel applies as it loads
    them (one kernel a layer fewer); only where takes_rotary says so. Returns [b, 1, heads, d]
    contiguous (transformers' attention-function layout). Under torch.compile it is one
    operator (graphrun::paged_decode), the cache writes declared.
    """
    if torch.compiler.is_compiling():
        assert rotary is None, "takes_rotary is False under torch.compile"
        return torch.ops.graphrun.paged_decode(q, k_new, v_new, k_cache, v_cache, block_table,
                                               seq_lens, scale)
    return _paged_decode(q, k_new, v_new, k_cache, v_cache, block_table, seq_lens, scale,
                         rotary)


def takes_rotary(q: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether paged_decode's kernel applies RoPE itself to q [b, heads, 1, d] with cos (and
    sin) [b, 1, 1, d]: the kernel runs, outside torch.compile, in float16 or bfloat16 (there
    each product rounds before the sum, as the eager ops round, whatever the compiler fuses),
    cos in q's dtype with unit last stride."""
    return (not torch.compiler.is_compiling() and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[2] == 1 and q.shape[3] % 2 == 0 and cos.dtype == q.dtype
            and cos.shape == (q.shape[0], 1, 1, q.shape[3]) and cos.stride(3) == 1
            and usable(q))


def write_prefill(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write a prefill's keys and values into their slots, in place.

    k, v [tokens, kv_heads, d]; slot_mapping [tokens] int64, flat slots
    (block * block_size + offset)."""
    call = torch.ops.graphrun.write_prefill if torch.compiler.is_compiling() else _write_prefill
    call(k, v, k_cache, v_cache, slot_mapping)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """One layer's cache [num_blocks, kv_heads, block_size, d] at `blocks` [P] int64, in order:
    [kv_heads, P * block_size, d]. Block 0 (padding) reads as zeros, so a masked key is never
    an inf that would turn a softmax weight of 0 into NaN."""
    _, kv_heads, block_size, dim = cache.shape
    picked = torch.where((blocks != 0)[:, None, None, None], cache[blocks], 0)
    return picked.transpose(0, 1).reshape(kv_heads, blocks.shape[0] * block_size, dim)


def paged_decode_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, softcap: float | None = None,
                           window: int | None = None) -> torch.Tensor:
    """paged_decode in plain torch, any device: the write, the blocks gathered through the
    table, then scaled_dot_product_attention with a per-row length mask. Two things the kernel
    does not do: softcap, the scores capped as softcap * tanh(score / softcap) first (Gemma2's
    attention); window, only the row's last `window` keys seen (a sliding-window layer)."""
    b, heads, _, dim = q.shape
    _, kv_heads, block_size, _ = k_cache.shape
    length = block_table.shape[1] * block_size
    pos = seq_lens.long() - 1  # [b]: the new key's position
    block = block_table.long().gather(1, (pos // block_size)[:, None])[:, 0]
    _write_slots(k_new[:, :, 0], v_new[:, :, 0], k_cache, v_cache, block * block_size
                 + pos % block_size)
    table = block_table.long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # [b, max_blocks, kv_heads, block_size, d] -> [b, kv_heads, max_blocks * block_size, d]
        return cache[table].transpose(1, 2).reshape(b, kv_heads, length, dim)

    at = torch.arange(length, device=q.device)[None]
    seen = at < seq_lens[:, None]  # [b, L]
    if window is not None:
        seen = seen & (at >= seq_lens[:, None] - window)
    # keys past a row's length may be anything a block held (garbage, inf): zeroed, a masked
    # key adds 0 * 0, never NaN
    keep = seen[:, None, :, None]
    keys = torch.where(keep, gather(k_cache), 0)
    values = torch.where(keep, gather(v_cache), 0)
    # GQA without repeating the cache: the query heads of a kv head are its extra query rows
    groups = heads // kv_heads
    queries = q.to(k_cache.dtype).reshape(b, kv_heads, groups, dim)
    out = attention(queries, keys, values, seen[:, None, None], scale, softcap)
    # out [b, kv_heads, groups, d] -> [b, 1, heads, d]
    return out.reshape(b, 1, heads, dim).to(q.dtype).contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              scale: float, softcap: float | None = None) -> torch.Tensor:
    """q [b, h, rows, d], k, v [b, h, L, d], mask bool broadcast to [b, h, rows, L] (True: seen)
    -> [b, h, rows, d]; with softcap the scores are capped before the softmax, which
    scaled_dot_product_attention cannot do, so they are computed in float32 here."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(weights, v.float()).to(q.dtype)


def _write_slots(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [n, kv_heads, d] into flat slots [n] int64 of [num_blocks, kv_heads, block_size, d]
    caches (index_put_: no host sync, so it captures)."""
    block_size = k_cache.shape[2]
    block, offset = slots // block_size, slots % block_size
    # advanced indices split by a slice index [n, kv_heads, d]: one slot's every head
    k_cache[block, :, offset] = k.to(k_cache.dtype)
    v_cache[block, :, offset] = v.to(v_cache.dtype)


def _write_prefill(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _write_slots(k, v, k_cache, v_cache, slot_mapping.long())


def _paged_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float,
                  rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    if usable(q):
        try:
            return _kernel_decode(q, k_new, v_new, k_cache, v_cache, block_table, seq_lens,
                                  scale, rotary=rotary)
        except Exception as err:  # noqa: BLE001 - a kernel that cannot run: the reference
            give_up(err)
    if rotary is not None:
        q, k_new = (rope_eager(x.transpose(1, 2), *rotary) for x in (q, k_new))
    return paged_decode_reference(q, k_new, v_new, k_cache, v_cache, block_table, seq_lens,
                                  scale)


# the kernel; imported on first use so a job that never decodes on a GPU never imports Triton
SWITCH = KernelSwitch("graphrun.models.causal.paged_kernels")


def usable(q: torch.Tensor) -> bool:
    """Whether the kernel can run the attention of q [b, heads, 1, head_dim]."""
    return runs_on(q.device, q.dtype, q.shape[3])


def runs_on(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a decode step's attention on this device, in this dtype, runs the kernel (Triton
    on a GPU, or its interpreter on the CPU with TRITON_INTERPRET=1)."""
    return (head_dim <= 256 and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and SWITCH.on(torch.device(device)))


def give_up(err: BaseException) -> None:
    """The kernel failed (a GPU or a Triton it cannot compile for): the reference from now on.
    Its first call is an eager step before any capture, so nothing was launched."""
    SWITCH.give_up(err)


def failure() -> str | None:
    """Why the kernel is no longer used in this process, or None."""
    return SWITCH.failure()


def check(out: torch.Tensor, k_cache: torch.Tensor, call: tuple,
          rotary: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """The kernel's output and the cache it wrote against the reference's on the same call
    (q, k_new, v_new, k_cache and v_cache as they were before it, table, lens, scale): a
    kernel that compiles on this GPU yet computes other values, beyond rounding, is given up
    (the warm-up's, before any step)."""
    q, k_new, v_new, k_before, v_before, *rest = call
    if rotary is not None:
        q, k_new = (rope_eager(x.transpose(1, 2), *rotary) for x in (q, k_new))
    want_cache = k_before.clone()
    want = paged_decode_reference(q, k_new, v_new, want_cache, v_before.clone(), *rest)
    for name, got, ref in (("output", out, want), ("key cache", k_cache, want_cache)):
        diff = beyond_rounding(got, ref, float32_tol=1e-4)  # a float32 sum in another order
        if diff is not None:
            give_up(RuntimeError(f"the paged decode kernel's {name} differs from the reference "
                                 f"on {got.device} by up to {diff:.3g}"))
            return


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float,
                   config: KernelConfig | None = None,
                   rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """paged_decode in Triton. The grid is (rows, kv_heads, shares), shares chosen from the rows
    and the table's width alone; a program whose share starts past its row's length returns at
    once, and a row whose keys fit one share is finished by that share (no merge). config: the
    launch, CONFIG when None; rotary: paged_decode's."""
    c = config or CONFIG
    split, merge = SWITCH.kernels.split, SWITCH.kernels.merge
    assert k_cache.stride() == v_cache.stride(), "k and v caches of one layout"
    b, heads, _, dim = q.shape
    _, kv_heads, block_size, _ = k_cache.shape
    length = block_table.shape[1] * block_size  # the most keys a row can have
    groups = heads // kv_heads
    # tensor-core products need 16 rows and 16 columns at least: query heads past the group's
    # are zero rows, columns past head_dim zero columns
    bg, bd = max(16, _pow2(groups)), max(16, _pow2(dim))
    shares = min(c.max_splits, _cdiv(length, c.tile), max(1, _cdiv(c.programs, b * kv_heads)))
    chunk = _cdiv(_cdiv(length, shares), c.tile) * c.tile  # columns per share, whole tiles
    shares = _cdiv(length, chunk)
    out = torch.empty((b, 1, heads, dim), dtype=q.dtype, device=q.device)
    merged = (b, kv_heads, shares) if shares > 1 else (1,)
    part = torch.empty((*merged, bg, bd), dtype=torch.float32, device=q.device)
    stat = torch.empty((*merged, 2, bg), dtype=torch.float32, device=q.device)
    cos, sin = rotary if rotary is not None else (q, q)  # q: a pointer never read
    split[(b, kv_heads, shares)](
        q, k_new, v_new, k_cache, v_cache, block_table, seq_lens, out, part, stat, cos, sin,
        scale, chunk, shares,
        q.stride(0), q.stride(1), q.stride(3), k_new.stride(0), k_new.stride(1),
        k_new.stride(3), v_new.stride(0), v_new.stride(1), v_new.stride(3),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        block_table.stride(0), block_table.stride(1), cos.stride(0) if rotary else 0,
        G=groups, BG=bg, D=dim, BD=bd, BN=c.tile, BLOCK=block_size,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ROPE=rotary is not None,
        num_warps=c.warps,
        num_stages=c.stages)
    if shares > 1:
        merge[(b, kv_heads)](out, part, stat, seq_lens, chunk, shares, G=groups,
                             BG=_pow2(groups), PG=bg, D=dim, BD=bd, BS=c.max_splits,
                             num_warps=c.merge_warps)
    return out


def _compiled_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return _paged_decode(q, k_new, v_new, k_cache, v_cache, block_table, seq_lens, scale)


_decode_op = torch.library.custom_op("graphrun::paged_decode", _compiled_decode,
                                     mutates_args=("k_cache", "v_cache"))


@_decode_op.register_fake
def _decode_shape(q, k_new, v_new, k_cache, v_cache, block_table, seq_lens, scale):
    b, heads, _, dim = q.shape
    return q.new_empty((b, 1, heads, dim))


_prefill_op = torch.library.custom_op("graphrun::write_prefill", _write_prefill,
                                      mutates_args=("k_cache", "v_cache"))


@_prefill_op.register_fake
def _prefill_shape(k, v, k_cache, v_cache, slot_mapping):
    return None
