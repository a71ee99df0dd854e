"""The pick's Triton kernels (generate/sampling.py's _kernel_pick launches them). pick_parts: per
row and part of the vocabulary, the largest score and its first column, for the greedy pick (the
scores as they are) and for the Gumbel-max draw (the scores divided by the row's temperature,
plus the noise of its stream), in one read of the scores. pick_rows: per row, the first part
holding its best, and the draw or the greedy pick by its temperature. The noise is computed
where it is used, from the row's key, its place in the completion and the column: the same
integer hashes, in uint64, and the same float32 operations in the same order as
sampling.row_streams' and sampling.gumbel's torch ops, divisions and logarithms rounded as
torch rounds them (IEEE division; tl.log is libdevice's logf, as torch's log is on a GPU), so
the draw is the eager one's: sampling.check_kernel makes sure on the job's GPU.

advance: a decode step's bookkeeping after its pick (generate/steps.py), one program for a
block of rows.
"""

import triton
import triton.language as tl

GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
MIX2 = tl.constexpr(0x94D049BB133111EB)
STEP = tl.constexpr(0xD1B54A32D192ED03)


@triton.jit
def _mix64(z):
    """splitmix64's finaliser on uint64 (logical shifts, wrapping multiplies)."""
    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    return z ^ (z >> 31)


@triton.jit
def pick_parts(scores, temperature, keys, index, greedy_best, greedy_at, drawn_best, drawn_at,
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
        # the row's stream: row_streams' mix64(key + index * STEP), wrapping as int64 does
        key = tl.load(keys + row).to(tl.uint64, bitcast=True)
        place = tl.load(index + row).to(tl.uint64, bitcast=True)
        stream = _mix64(key + place * STEP)
        z = _mix64(stream + (cols.to(tl.uint64) + 1) * GOLDEN)
        u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        v = tl.where(real, x + -tl.log(-tl.log(u)), float("-inf"))
        tl.store(drawn_best + out, tl.max(v, 0))
        tl.store(drawn_at + out, part * BLOCK + tl.argmax(v, 0, tie_break_left=True))


@triton.jit
def pick_rows(greedy_best, greedy_at, drawn_best, drawn_at, temperature, token, rows, parts,
              R: tl.constexpr, BP: tl.constexpr, GREEDY: tl.constexpr, DRAW: tl.constexpr):
    """Rows [program_id(0) * R, + R): the first part holding the row's largest (greedy and
    drawn, as pick_parts wrote them), then the draw where the row's temperature is above 0
    (both given), into token [rows] int64."""
    r = tl.program_id(0) * R + tl.arange(0, R)
    p = tl.arange(0, BP)
    live = r < rows
    inside = live[:, None] & (p < parts)[None, :]
    at = r[:, None] * parts + p[None, :]
    if GREEDY:
        first = tl.argmax(tl.load(greedy_best + at, mask=inside, other=float("-inf")), 1,
                          tie_break_left=True)
        picked = tl.load(greedy_at + r * parts + first, mask=live, other=0)
    if DRAW:
        first = tl.argmax(tl.load(drawn_best + at, mask=inside, other=float("-inf")), 1,
                          tie_break_left=True)
        drawn = tl.load(drawn_at + r * parts + first, mask=live, other=0)
        if GREEDY:
            picked = tl.where(tl.load(temperature + r, mask=live, other=0.0) > 0, drawn,
                              picked)
        else:
            picked = drawn
    tl.store(token + r, picked.to(tl.int64), mask=live)


@triton.jit
def advance(picked, done, stops, index, max_new, seq_lens, token, last, pad, rows, stride,
            width, R: tl.constexpr, BS: tl.constexpr):
    """Rows [program_id(0) * R, + R) of a decode step, after its pick (picked [rows] int64):
    a stopped row's pick becomes pad; a live row moves on (index, seq_lens) and stops at one
    of its stop ids [rows, width] or at max_new; token and last get the pick. The torch ops
    of steps.advance_eager, in one pass."""
    r = tl.program_id(0) * R + tl.arange(0, R)
    inside = r < rows
    was = tl.load(done + r, mask=inside, other=1) != 0
    tok = tl.where(was, pad, tl.load(picked + r, mask=inside, other=0))
    s = tl.arange(0, BS)
    ids = tl.load(stops + r[:, None] * stride + s[None, :],
                  mask=inside[:, None] & (s < width)[None, :], other=-1)
    hit = tl.max((ids == tok[:, None]).to(tl.int32), 1) > 0
    place = tl.load(index + r, mask=inside, other=0) + tl.where(was, 0, 1)
    ends = hit | (place >= tl.load(max_new + r, mask=inside, other=0))
    tl.store(index + r, place, mask=inside)
    tl.store(done + r, (was | ends).to(tl.int1), mask=inside)
    tl.store(seq_lens + r, tl.load(seq_lens + r, mask=inside, other=0) + tl.where(was, 0, 1),
             mask=inside)
    tl.store(token + r, tok, mask=inside)
    tl.store(last + r, tok, mask=inside)
