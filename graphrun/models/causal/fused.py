"""The elementwise work of a Llama step between its matrix multiplies, fused: the residual add
with the RMSNorm after it, RoPE on q and k at once, and silu(gate) * up. At a decode step's
rows each is bound by memory and by launches: eager torch runs each as several small kernels
that each read and write the whole activation; here each is one Triton kernel
(models/causal/fused_kernels.py) that reads its inputs once.

Each function computes what its eager ops compute (the `_eager` functions beside it, the math
models/causal/llama.py ran before), in float32 and rounded where the eager ops round, so the
values agree up to the order of a sum. `kernel=False`, a tensor the kernels cannot take (not
on a GPU, outside Triton's interpreter on the CPU, a dtype other than float16/bfloat16/float32),
torch.compile tracing (inductor fuses these ops itself), or a process where a kernel has
already failed (give_up): the eager ops. A kernel's first call is an eager step before any
capture, so a kernel that cannot compile fails there, and `failure()` says why.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from graphrun.base.triton_switch import KernelSwitch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
WIDEST_NORM = 16384  # a norm's row is one program's registers: wider rows take the eager ops
SILU_TILE = 1024  # columns of silu(gate) * up one program computes


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, weight * rms_norm(x + delta)); delta None: (x, weight * rms_norm(x)).

    x, delta [..., n] of one dtype; weight [n]. The residual and the normed output have x's
    shape and dtype (a weight of another dtype takes the eager ops, whose product promotes)."""
    n = x.shape[-1]
    if not (kernel and n <= WIDEST_NORM and weight.dtype == x.dtype and weight.shape == (n,)
            and weight.is_contiguous()
            and (delta is None or (delta.dtype == x.dtype and delta.shape == x.shape))
            and usable(x)):
        return add_rms_norm_eager(x, delta, weight, eps)
    try:
        return _add_rms_norm(x, delta, weight, eps)
    except Exception as err:  # noqa: BLE001 - a kernel that cannot run: the eager ops
        give_up(err)
    return add_rms_norm_eager(x, delta, weight, eps)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         kernel: bool = True) -> torch.Tensor:
    """Llama's RoPE (the half-split convention) on every head of qk [b, q, heads, d] ->
    [b, heads, q, d], laid out in memory as [b, q, heads, d] (as the eager ops leave it); cos,
    sin [b, 1, q, d] in qk's dtype."""
    b, q_len, heads, d = qk.shape
    if not (kernel and d % 2 == 0 and qk.stride(3) == 1 and cos.dtype == sin.dtype == qk.dtype
            and cos.shape == sin.shape == (b, 1, q_len, d) and cos.stride() == sin.stride()
            and cos.stride(3) == 1 and usable(qk)):
        return rope_eager(qk, cos, sin)
    try:
        return _rope(qk, cos, sin)
    except Exception as err:  # noqa: BLE001
        give_up(err)
    return rope_eager(qk, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, kernel: bool = True) -> torch.Tensor:
    """silu(gate) * up, gate and up [..., n] of one shape and dtype (the two halves of a fused
    gate_up projection's output, or two projections' outputs)."""
    if not (kernel and gate.shape == up.shape and gate.dtype == up.dtype and usable(gate)):
        return silu_mul_eager(gate, up)
    try:
        return _silu_mul(gate, up)
    except Exception as err:  # noqa: BLE001
        give_up(err)
    return silu_mul_eager(gate, up)


def add_rms_norm_eager(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama norm after the residual add: torch's rms_norm without a weight
    computes in float32 and rounds once; the weight applies after (models/causal/llama.py)."""
    if delta is not None:
        x = x + delta
    return x, weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def rope_eager(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin on qk transposed to [b, heads, q, d]."""
    x = qk.transpose(1, 2)
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


def silu_mul_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# the kernels; imported on first use so a job that never runs a Llama step on a GPU never
# imports Triton
SWITCH = KernelSwitch("graphrun.models.causal.fused_kernels")


def usable(t: torch.Tensor) -> bool:
    """Whether the kernels can take t: on a GPU, or on the CPU under Triton's interpreter
    (TRITON_INTERPRET=1), in a dtype they compute, outside torch.compile's tracing, while no
    kernel has failed in this process, with Triton importable."""
    if torch.compiler.is_compiling():  # first: dynamo traces nothing past it
        return False
    return t.dtype in DTYPES and SWITCH.on(t.device)


def give_up(err: BaseException) -> None:
    """A kernel failed (a Triton that cannot compile for this GPU): the eager ops from now on."""
    SWITCH.give_up(err)


def beyond_rounding(got: torch.Tensor, want: torch.Tensor,
                    float32_tol: float = 1e-5) -> float | None:
    """How far a kernel's output is from its oracle's where that is more than rounding (2e-2
    in float16/bfloat16, float32_tol in float32), else None: the warm-up's checks."""
    tol = float32_tol if got.dtype == torch.float32 else 2e-2
    if torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
        return None
    return (got.float() - want.float()).abs().max().item()


def check(name: str, got, want) -> None:
    """A kernel's outputs against the eager ops' on the same inputs (the warm-up's): kernels
    that compile on this GPU yet compute other values than the eager ops, beyond rounding,
    are given up, so every later step takes the eager ops."""
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        diff = beyond_rounding(g, w)
        if diff is not None:
            give_up(RuntimeError(f"the fused {name} kernel differs from the eager ops on "
                                 f"{g.device} by up to {diff:.3g}"))
            return


def failure() -> str | None:
    """Why the fused kernels are no longer used in this process, or None."""
    return SWITCH.failure()


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., n] as [rows, n] with unit column stride: a view where the strides allow."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


def _warps(width: int) -> int:
    return min(16, max(1, width // 512))  # a row of 4096 on 8 warps: 16 values a thread


def _add_rms_norm(x, delta, weight, eps):
    n = x.shape[-1]
    x2 = _rows(x)
    d2 = _rows(delta) if delta is not None else x2
    res = torch.empty(x.shape, dtype=x.dtype, device=x.device) if delta is not None else x
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    r2, o2 = res.view(-1, n), out.view(-1, n)
    if x2.shape[0]:
        SWITCH.kernels.add_rms_norm[(x2.shape[0],)](
            x2, d2, weight, r2, o2, eps, x2.stride(0), d2.stride(0), r2.stride(0), o2.stride(0),
            N=n, BLOCK=_pow2(n), ADD=delta is not None, num_warps=_warps(n))
    return res, out


def _rope(qk, cos, sin):
    b, q_len, heads, d = qk.shape
    half = d // 2
    out = torch.empty((b, q_len, heads, d), dtype=qk.dtype, device=qk.device)
    bh = min(_pow2(heads), max(1, 2048 // _pow2(half)))  # 2048 pairs a program, 16 a thread
    if out.numel():
        # no fused multiply-add: each product rounds on its own, as torch's separate ops do
        SWITCH.kernels.rope[(b * q_len, -(-heads // bh))](
            qk, cos, sin, out, q_len, heads, qk.stride(0), qk.stride(1), qk.stride(2),
            cos.stride(0), cos.stride(2), HALF=half, BH=bh, BHALF=_pow2(half),
            num_warps=4, enable_fp_fusion=False)
    return out.transpose(1, 2)


def _silu_mul(gate, up):
    n = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    o2 = out.view(-1, n)
    tile = min(SILU_TILE, _pow2(n))
    if g2.shape[0] and n:
        SWITCH.kernels.silu_mul[(g2.shape[0], -(-n // tile))](
            g2, u2, o2, g2.stride(0), u2.stride(0), o2.stride(0), N=n, BLOCK=tile,
            num_warps=4)
    return out
