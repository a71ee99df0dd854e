"""A packed prefill's attention: the step's prompts packed into one sequence of T tokens, each
token attending to the earlier tokens of its own prompt.

On a GPU in float16 or bfloat16 it is torch's variable-length flash attention (the aten
operator behind torch.nn.attention.varlen): the prompts' boundaries are data (`starts`,
cumulative lengths in a static buffer), so one captured prefill serves every mix of prompts, no
block of scores across two prompts is computed, and no per-shape plan is built when a graph is
set up (the dense masked attention builds a cuDNN plan per packed size). Elsewhere, with a
softcap, over cached prefix keys, and for the rest of the process once it has failed
(give_up): the masked attention (kv_cache.fresh_attend), which is also its oracle.

`starts` [n + 2] int32: where each packed prompt starts, then where the padding starts, then T
for every entry left (empty sequences). The padding attends to itself: what it computes is
written to the trash block and never read.
"""

from __future__ import annotations

import torch

from graphrun.base.triton_switch import KernelFailures

FAILURES = KernelFailures()  # why it no longer runs in this process


def runs(q: torch.Tensor, softcap: float | None) -> bool:
    """Whether the flash kernel can run the attention of q [1, heads, T, head_dim]."""
    return softcap is None and runs_on(q.device, q.dtype, q.shape[-1])


def runs_on(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a prefill's attention (no softcap, no cached keys) on this device, in this
    dtype, runs the flash kernel: a GPU of compute capability 8.0 or later, half precision,
    a head of at most 256 in multiples of 8, torch's build with flash attention, none
    failed."""
    if FAILURES.failures or device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if head_dim > 256 or head_dim % 8:
        return False
    return (torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device) >= (8, 0))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
           scale: float, window: int | None = None) -> torch.Tensor:
    """q [1, heads, T, d]; k, v [1, kv_heads, T, d] -> [1, T, heads, d] (grouped-query
    attention is the kernel's own: kv head h // (heads // kv_heads) for query head h). window:
    a query sees only the keys less than `window` positions before it.

    The aten operator itself, not torch.nn.attention.varlen.varlen_attn: that wrapper is a
    custom operator whose first call imports torch._dynamo, seconds of a fresh process."""
    total = q.shape[2]
    out = torch.ops.aten._flash_attention_forward(
        q[0].transpose(0, 1), k[0].transpose(0, 1).to(q.dtype), v[0].transpose(0, 1).to(q.dtype),
        starts, starts, total, total, 0.0, False, False, scale=scale,
        window_size_left=-1 if window is None else window - 1, window_size_right=0)[0]
    return out[None]


def give_up(err: BaseException) -> None:
    """The kernel failed: the masked attention from now on. Its first call is an eager step
    before any capture, so nothing was launched."""
    FAILURES.give_up(err)


def failure() -> str | None:
    """Why the kernel is no longer used in this process, or None."""
    return FAILURES.failure()
