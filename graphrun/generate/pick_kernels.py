"""The pick's Triton kernel, pick_parts (generate/sampling.py's _kernel_pick launches it): per row
and part of the vocabulary, the largest score and its first column, for the greedy pick (the
scores as they are) and for the Gumbel-max draw (the scores divided by the row's temperature,
plus the noise of its stream), in one read of the scores. The noise is computed where it is
used, from the stream and the column: the same integer hash, in uint64, and the same float32
operations in the same order as sampling.gumbel's torch ops, divisions and logarithms rounded as
torch rounds them (IEEE division; tl.log is libdevice's logf, as torch's log is on a GPU), so
the draw is the eager one's: sampling.check_kernel makes sure on the job's GPU.
"""

import triton
import triton.language as tl

GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
MIX2 = tl.constexpr(0x94D049BB133111EB)


@triton.jit
def _mix64(z):
    """splitmix64's finaliser on uint64 (logical shifts, wrapping multiplies)."""
    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    return z ^ (z >> 31)


@triton.jit
def pick_parts(scores, temperature, streams, greedy_best, greedy_at, drawn_best, drawn_at,
               vocab, stride, parts, BLOCK: tl.constexpr, GREEDY: tl.constexpr,
               DRAW: tl.constexpr, DIVIDE: tl.constexpr):
    """One program: row program_id(0), columns [part * BLOCK, part * BLOCK + BLOCK)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    real = cols < vocab
    x = tl.load(scores + row.to(tl.int64) * stride + cols, mask=real, other=float("-inf"))
    out = row * parts + part
    if GREEDY:
        tl.store(greedy_best + out, tl.max(x, 0))
        tl.store(greedy_at + out, part * BLOCK + tl.argmax(x, 0, tie_break_left=True))
    if DRAW:
        if DIVIDE:
            t = tl.load(temperature + row)
            x = tl.math.div_rn(x, tl.where(t > 0, t, 1.0))
        stream = tl.load(streams + row).to(tl.uint64, bitcast=True)
        z = _mix64(stream + (cols.to(tl.uint64) + 1) * GOLDEN)
        u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        v = tl.where(real, x + -tl.log(-tl.log(u)), float("-inf"))
        tl.store(drawn_best + out, tl.max(v, 0))
        tl.store(drawn_at + out, part * BLOCK + tl.argmax(v, 0, tie_break_left=True))
