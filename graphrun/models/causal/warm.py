"""The kernels' warm-up, on a thread beside the job's imports, setup and weights' load.

A fresh process's first engine would spend its graph set-up on work that depends on the model's
layout alone, not on its weights: Triton compiling the paged decode kernels
(models/causal/paged_kernels.py: the compile, its launcher built, the module loaded), and the
first scaled_dot_product_attention and matrix multiply loading their kernels. The layout
(heads, KV heads, head dim, width), the dtype and the KV block size are known once config.json
is read (or a builtin's arguments), before any weight is. So a job begins this at its process's
start, beside its imports and setup (generate/runner.begin_warm_up: the thread reads the layout
once the device has started, and register() keeps it for the runner to claim()), else the
runner does once it has read the layout (WarmUp.begin), beside the weights' load; the engine
waits for it before its first graph (Engine(warm=...)). The wait is the phase "kernel warm-up"
and generation.warm_up in the manifest; this thread's own time is there too.

torch keeps cuDNN's attention plans (and cuBLAS's handles) per thread, so what this thread
builds for them serves only itself: where the prefill's attention is the masked one (not the
flash kernel: models/causal/packed_attention.py), the engine builds the prefill graphs'
attention plans on its own thread while it waits (attention_plans).

The tensors are laid out as the model lays them out (graphrun's Llama: q, k and v of its fused
projection through its RoPE, and its fused elementwise kernels; GPT-2: its split), since
Triton compiles one kernel per specialization (the strides' and pointers' divisibility): the
engine's steps then find what they launch in each kernel's cache. A failure here is recorded
and nothing else: the kernel is not given up (paged_attention.give_up), so the engine's first
step compiles again and reports a failure as it always has.

Threads: the device's context exists before the thread starts (begin makes sure, on the
caller's thread); the thread makes the device current, works on the default stream (its blocks
go back to the allocator for everyone) and is the only caller of the paged kernels until the
engine has waited, so no kernel's cache is filled from two threads. torch's cuBLAS handles
are per thread and return to torch's pool when the thread ends.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from graphrun.base.errors import first_line
from graphrun.models.causal import packed_attention, paged_attention
from graphrun.models.causal.kv_cache import fresh_attend

PREFILL_TOKENS = 64  # the warm-up's packed prefill: enough tokens for the kernels a long one picks
DECODE_KEYS = 256  # a decode row's keys: more than one share (so the merge kernel runs too)
NO_CUDA = "no CUDA device"


@dataclass(frozen=True)
class Layout:
    """What the kernels are compiled for: one attention layer's heads and widths. fused:
    "llama" (q, k, v of one projection, RoPE on q and k at once) or "gpt2" (c_attn's split)."""

    heads: int
    kv_heads: int
    head_dim: int
    width: int  # d_model: the projections' input
    fused: str = "llama"
    ffn: int = 0  # the MLP's width (Llama): silu(gate) * up's kernel is compiled for it


def layout_of(shape) -> Layout:
    """A LlamaShape's or GPT2Shape's Layout (models/checkpoint.py)."""
    gpt2 = shape.family == "GPT-2"
    return Layout(shape.heads, shape.heads if gpt2 else shape.kv_heads, shape.head_dim,
                  shape.d_model, "gpt2" if gpt2 else "llama", 0 if gpt2 else shape.ffn)


_EARLY: dict[tuple, "WarmUp"] = {}  # begun before the runner, by its job's key: claimed once
_LOCK = threading.Lock()


def register(key: tuple, make: Callable[[], "WarmUp"]) -> None:
    """make() begun and kept under `key` for claim(), unless one is kept there already."""
    with _LOCK:
        if key not in _EARLY:
            _EARLY[key] = make()


def claim(key: tuple) -> "WarmUp | None":
    """The warm-up register() began under `key`, taken (each is waited for once), or None."""
    with _LOCK:
        return _EARLY.pop(key, None)


class Skip(Exception):
    """Raised by a warm-up's work: there is nothing to warm (its reason, the report's)."""


class WarmUp:
    """`work` run on a daemon thread; wait() joins it and never raises. What it did is
    report(): status done | failed | skipped, reason, run_s (its own time), wait_s (the
    waiter's), kernels (what it warmed)."""

    def __init__(self, work: Callable[[], list[str]] | None, reason: str | None = None):
        self._work = work
        self.status = "running" if work is not None else "skipped"
        self.reason = reason
        self.kernels: list[str] = []
        self.run_s: float | None = None
        self.wait_s = 0.0
        self._waited = False
        self._thread = None
        if work is not None:
            self._thread = threading.Thread(target=self._run, name="graphrun-kernel-warm-up",
                                            daemon=True)
            self._thread.start()

    @classmethod
    def begin(cls, layout: Layout, device: torch.device, dtype: torch.dtype,
              block_size: int,
              also: Callable[[torch.device], list[str]] | None = None) -> "WarmUp":
        """The warm-up of `layout`'s kernels on `device`, begun; skipped without CUDA. also:
        the caller's own kernels' warm-up after them, on the same thread (what it warmed)."""
        device = torch.device(device)
        if device.type != "cuda":
            return cls(None, NO_CUDA)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.zeros(1, device=device)  # the context, made on the caller's thread if not yet
        return cls(lambda: warm_kernels(layout, device, dtype, block_size)
                   + (also(device) if also is not None else []))

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.kernels = self._work()
            self.status = "done"
        except Skip as why:
            self.status, self.reason = "skipped", str(why)
        except Exception as err:  # noqa: BLE001 - not fatal: the engine's steps compile anew
            self.status, self.reason = "failed", first_line(err)
        finally:
            self.run_s = time.perf_counter() - t0

    def wait(self) -> None:
        """Until the warm-up has ended; the first wait's seconds are wait_s."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        if not self._waited:
            self._waited, self.wait_s = True, time.perf_counter() - t0

    def report(self) -> dict:
        return {"status": self.status, "reason": self.reason, "run_s": self.run_s,
                "wait_s": self.wait_s, "kernels": list(self.kernels)}


def warm_kernels(layout: Layout, device: torch.device, dtype: torch.dtype,
                 block_size: int) -> list[str]:
    """One q, k, v projection's matrix multiply (a row, a prefill), a prefill's attention and,
    where the kernel runs (paged_attention.runs_on), a decode step's paged attention at 1 and
    2 rows, on small tensors; returns what ran. Any device: on the CPU under TRITON_INTERPRET
    it runs the kernels in Triton's interpreter (the tests')."""
    h, g, d = layout.heads, layout.kv_heads, layout.head_dim
    with torch.no_grad(), (torch.cuda.device(device) if device.type == "cuda"
                           else nullcontext()):
        gen = torch.Generator(device).manual_seed(0)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=gen, device=device, dtype=dtype)

        width = 3 * h * d if layout.fused == "gpt2" else (h + 2 * g) * d
        weight = randn(width, layout.width)
        for rows in (1, PREFILL_TOKENS):
            torch.nn.functional.linear(randn(rows, layout.width), weight)
        done = ["matmul"]
        q, k, v = model_qkv(layout, 1, PREFILL_TOKENS, randn)
        done.append(prefill_attention(q, k, v, d ** -0.5))
        if layout.fused == "llama":
            done += warm_fused(layout, randn)
        if paged_attention.runs_on(device, dtype, d):
            blocks = -(-DECODE_KEYS // block_size)
            for rows in (1, 2):  # 1: the split kernel and the merge; 2: strides of more rows
                q, k, v, rotary = decode_qkv(layout, rows, randn)
                # each row its own blocks (a new key each), block 0 the trash block
                table = torch.arange(1, rows * blocks + 1, dtype=torch.int32,
                                     device=device).view(rows, blocks)
                lens = torch.full((rows,), DECODE_KEYS, dtype=torch.int32, device=device)
                before = [randn(rows * blocks + 1, g, block_size, d) for _ in "kv"]
                k_cache, v_cache = (c.clone() for c in before)
                out = paged_attention._kernel_decode(q, k, v, k_cache, v_cache, table, lens,
                                                     d ** -0.5, rotary=rotary)
                paged_attention.check(out, k_cache, (q, k, v, *before, table, lens, d ** -0.5),
                                      rotary)
            if not paged_attention.failure():
                done.append("paged decode")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return done


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> str:
    """A packed prefill's attention over two prompts, as its steps run it: the flash kernel
    where it runs (packed_attention.py), else the masked attention."""
    n = q.shape[2]
    if packed_attention.runs(q, None):
        starts = torch.tensor([0, n // 2, n], dtype=torch.int32, device=q.device)
        packed_attention.attend(q, k, v, starts, scale)
        return "prefill attention (flash)"
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    mask[n // 2:, :n // 2] = False
    fresh_attend(q, k, v, mask[None, None], scale)
    return "prefill attention"


def attention_plans(layout: Layout, device: torch.device, dtype: torch.dtype,
                    tokens: Iterable[int], until: Callable[[], bool] = lambda: False) -> int:
    """The captured prefills' attention (their own keys, none cached) run once at each packed
    size in `tokens`, largest first, on the calling thread, until `until()` says stop;
    returns how many ran. torch keeps cuDNN's attention plans per thread, so the thread that
    captures the prefill graphs builds them: the engine does it here while the warm-up thread
    compiles (until: the warm-up has ended; a plan built here costs more than in the capture,
    so only a wait pays for it), the warm-up thread then the only caller of the Triton
    kernels (RoPE by the eager ops)."""
    gen = torch.Generator(device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    def attend(n: int) -> None:
        q, k, v = model_qkv(layout, 1, n, randn, kernel=False)
        mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]
        fresh_attend(q, k, v, mask, layout.head_dim ** -0.5)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # until() is asked of a plan built, not queued

    if packed_attention.runs_on(device, dtype, layout.head_dim):
        return 0  # the flash kernel builds no plan per size
    ran = 0
    with torch.no_grad(), (torch.cuda.device(device) if device.type == "cuda"
                           else nullcontext()):
        for n in sorted(set(tokens), reverse=True):
            if until():
                break
            attend(n)
            ran += 1
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the graphs capture into a pool of their own
    return ran


def warm_fused(layout: Layout, randn) -> list[str]:
    """graphrun's Llama's fused elementwise kernels (models/causal/fused.py) at a decode
    step's and a prefill's shapes, as its layers call them: the norm with and without the
    residual add, and silu(gate) * up on the halves of the fused gate_up output (RoPE ran in
    model_qkv), each checked against the eager ops (fused.check). What ran by its kernel,
    not by the eager ops."""
    from graphrun.models.causal import fused

    n, ffn = layout.width, layout.ffn
    weight = randn(n)
    for rows, tokens in ((1, 1), (1, PREFILL_TOKENS)):
        x, delta = randn(rows, tokens, n), randn(rows, tokens, n)
        for d in (None, delta):
            fused.check("add_rms_norm", fused.add_rms_norm(x, d, weight, 1e-6),
                        fused.add_rms_norm_eager(x, d, weight, 1e-6))
        if ffn:
            gate, up = randn(rows, tokens, 2 * ffn).chunk(2, dim=-1)
            fused.check("silu_mul", fused.silu_mul(gate, up), fused.silu_mul_eager(gate, up))
    return [] if fused.failure() or not fused.usable(weight) else ["fused elementwise"]


def model_qkv(layout: Layout, rows: int, tokens: int, randn,
              kernel: bool = True) -> tuple[torch.Tensor, ...]:
    """q [rows, heads, tokens, d], k, v [rows, kv_heads, tokens, d] as the model's attention
    hands them to kv_cache.attend, strides included (models/causal/llama.py, gpt2.py).
    kernel: RoPE by its Triton kernel (checked against the eager ops), else by the eager ops
    (the same layout)."""
    from graphrun.models.causal import fused

    h, g, d = layout.heads, layout.kv_heads, layout.head_dim
    if layout.fused == "gpt2":
        x = randn(rows, tokens, 3 * h * d)
        return tuple(t.view(rows, tokens, h, d).transpose(1, 2) for t in x.split(h * d, dim=2))
    x = randn(rows, tokens, (h + 2 * g) * d)  # the fused q, k, v projection's output
    qk, v = x.split([(h + g) * d, g * d], dim=-1)
    qk = qk.view(rows, tokens, h + g, d)
    angles = randn(rows, 1, tokens, d)
    cos, sin = angles.cos(), angles.sin()
    turned = fused.rope(qk, cos, sin, kernel=kernel)
    if kernel:
        fused.check("rope", turned, fused.rope_eager(qk, cos, sin))
    q, k = turned.split([h, g], dim=1)
    return q, k, v.view(rows, tokens, g, d).transpose(1, 2)



def decode_qkv(layout: Layout, rows: int, randn) -> tuple:
    """A decode step's (q, k, v, rotary) as the model hands them to paged_decode: graphrun's
    Llama's q and k before RoPE with its (cos, sin) where the kernel applies it
    (kv_cache.attend_rotary), else model_qkv's and None."""
    h, g, d = layout.heads, layout.kv_heads, layout.head_dim
    if layout.fused == "llama":
        x = randn(rows, 1, (h + 2 * g) * d)
        qk, v = x.split([(h + g) * d, g * d], dim=-1)
        qk = qk.view(rows, 1, h + g, d).transpose(1, 2)
        angles = randn(rows, 1, 1, d)
        cos, sin = angles.cos(), angles.sin()
        if paged_attention.takes_rotary(qk[:, :h], cos):
            return qk[:, :h], qk[:, h:], v.view(rows, 1, g, d).transpose(1, 2), (cos, sin)
    return (*model_qkv(layout, rows, 1, randn), None)
