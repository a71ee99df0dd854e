"""The Triton kernels of models/causal/fused.py: the elementwise work between a Llama step's matrix
multiplies, each in one pass over its rows. Every value is computed in float32 and rounded to the
storage dtype wherever torch's eager ops round, so a kernel's output is the eager ops' up to the
order of a sum. Imported only where fused.py uses them (it imports Triton).
"""

import triton
import triton.language as tl


@triton.jit
def add_rms_norm(X, DELTA, W, RES, OUT, eps, sx, sdelta, sres, sout,
                 N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    # one program per row of [rows, N]; ADD: the residual x + delta first, written to RES
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    inside = c < N
    x = tl.load(X + row * sx + c, mask=inside, other=0.0)
    if ADD:
        delta = tl.load(DELTA + row * sdelta + c, mask=inside, other=0.0)
        # rounded as eager's `x + delta` is: the norm reads the residual it stores
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(RES.dtype.element_ty)
        tl.store(RES + row * sres + c, x, mask=inside)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=0) / N + eps)
    # F.rms_norm rounds once to the input's dtype; the weight's product rounds again
    normed = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + c, mask=inside, other=0.0).to(tl.float32)
    tl.store(OUT + row * sout + c, (normed * w).to(OUT.dtype.element_ty), mask=inside)


@triton.jit
def rope(QK, COS, SIN, OUT, q_len, heads, sqk_b, sqk_q, sqk_h, sc_b, sc_q,
         HALF: tl.constexpr, BH: tl.constexpr, BHALF: tl.constexpr):
    # program (b * q_len + t, tile of heads): qk [b, q, heads, 2 HALF] -> out, its shape, dense;
    # cos, sin [b, q, 2 HALF]. Products and sums round as eager's x * cos + rotate_half(x) * sin
    bt = tl.program_id(0).to(tl.int64)
    b, t = bt // q_len, bt % q_len
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    j = tl.arange(0, BHALF)
    hm, jm = hs < heads, j < HALF
    both = hm[:, None] & jm[None, :]
    dt = OUT.dtype.element_ty
    at = QK + b * sqk_b + t * sqk_q + hs[:, None] * sqk_h + j[None, :]
    x1 = tl.load(at, mask=both, other=0.0).to(tl.float32)  # [BH, BHALF]
    x2 = tl.load(at + HALF, mask=both, other=0.0).to(tl.float32)
    trig = b * sc_b + t * sc_q + j
    c1 = tl.load(COS + trig, mask=jm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(COS + trig + HALF, mask=jm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(SIN + trig, mask=jm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(SIN + trig + HALF, mask=jm, other=0.0).to(tl.float32)[None, :]
    # rotate_half(x) = cat(-x2, x1)
    o1 = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    to = OUT + (bt * heads + hs[:, None]) * (2 * HALF) + j[None, :]
    tl.store(to, o1.to(dt), mask=both)
    tl.store(to + HALF, o2.to(dt), mask=both)


@triton.jit
def silu_mul(GATE, UP, OUT, sgate, sup, sout, N: tl.constexpr, BLOCK: tl.constexpr):
    # program (row, column tile) of [rows, N]: silu(gate) * up, silu rounded first as F.silu's is
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = c < N
    g = tl.load(GATE + row * sgate + c, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(UP + row * sup + c, mask=inside, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    silu = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(dt).to(tl.float32)  # torch's x / (1 + e^-x)
    tl.store(OUT + row * sout + c, (silu * u).to(dt), mask=inside)
