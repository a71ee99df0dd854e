"""The Triton kernels of generate/decode_attention.py: `split` attends one share of a (row,
KV head)'s cache columns, or all of them; `merge` combines the shares. Imported only where
decode_attention uses them (it imports Triton).
"""

import triton
import triton.language as tl


# one compilation for every bucket: a length or share size is never specialized on
@triton.jit(do_not_specialize=["length", "chunk"])
def split(Q, KN, VN, CK, CV, MASK, COL, OUT, PART, STAT, scale, length, chunk,
          sq_b, sq_h, sq_d, sk_b, sk_h, sk_d, sv_b, sv_h, sv_d,
          sc_b, sc_h, sc_n, sc_d, sm_b, sm_n,
          G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
          BN: tl.constexpr, PRECISION: tl.constexpr):
    # 64-bit offsets: rows x a row's cache can pass 2**31 elements in a large cache
    row, h, s = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    shares = tl.num_programs(2)
    g, d = tl.arange(0, BG), tl.arange(0, BD)
    gm, dm = g < G, d < D
    q = tl.load(Q + row * sq_b + (h * G + g)[:, None] * sq_h + d[None, :] * sq_d,
                mask=gm[:, None] & dm[None, :], other=0.0)  # [BG, BD], rows past G zero
    q = (q.to(tl.float32) * scale).to(CK.dtype.element_ty)
    col = tl.load(COL + row)
    k_new = tl.load(KN + row * sk_b + h * sk_h + d * sk_d, mask=dm, other=0.0)
    v_new = tl.load(VN + row * sv_b + h * sv_h + d * sv_d, mask=dm, other=0.0)
    k_new, v_new = k_new.to(CK.dtype.element_ty), v_new.to(CV.dtype.element_ty)
    at = row * sc_b + h * sc_h + col * sc_n + d * sc_d
    tl.store(CK + at, k_new, mask=dm & (s == 0))
    tl.store(CV + at, v_new, mask=dm & (s == 0))
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, length)
    for i in range(0, chunk, BN):
        n = lo + i + tl.arange(0, BN)
        inside = n < hi
        seen = tl.load(MASK + row * sm_b + n * sm_n, mask=inside, other=0) != 0
        kv_at = row * sc_b + h * sc_h + n[:, None] * sc_n + d[None, :] * sc_d
        both = inside[:, None] & dm[None, :]
        k = tl.load(CK + kv_at, mask=both, other=0.0)  # [BN, BD]
        v = tl.load(CV + kv_at, mask=both, other=0.0)
        here = (n == col)[:, None]  # the new column, from the step's own k and v
        k = tl.where(here, k_new[None, :], k)
        v = tl.where(here, v_new[None, :], v)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BG, BN] float32
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: no NaN
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(scores - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if shares == 1:  # the answer itself, into out [b, 1, heads, D]
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        heads = tl.num_programs(1) * G
        tl.store(OUT + (row * heads + h * G + g)[:, None] * D + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=gm[:, None] & dm[None, :])
    else:  # part [b, kv_heads, MAX_SPLITS, BG, BD], stat [b, kv_heads, MAX_SPLITS, 2, BG]
        base = (row * tl.num_programs(1) + h) * shares + s
        tl.store(PART + (base * BG + g)[:, None] * BD + d[None, :], acc)
        tl.store(STAT + (base * 2) * BG + g, m_i)
        tl.store(STAT + (base * 2 + 1) * BG + g, l_i)

@triton.jit(do_not_specialize=["shares"])
def merge(OUT, PART, STAT, shares, G: tl.constexpr, BG: tl.constexpr, PG: tl.constexpr,
          D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr):
    # PG: the rows per share the split kernel wrote; BG: the real ones, to a power of two
    row, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    kv_heads = tl.num_programs(1)
    s, g, d = tl.arange(0, BS), tl.arange(0, BG), tl.arange(0, BD)
    sm = s < shares
    base = (row * kv_heads + h) * shares + s  # [BS]
    m = tl.load(STAT + (base * 2)[:, None] * PG + g[None, :], mask=sm[:, None],
                other=float("-inf"))  # [BS, BG]
    l = tl.load(STAT + (base * 2 + 1)[:, None] * PG + g[None, :], mask=sm[:, None],
                other=0.0)
    top = tl.max(m, axis=0)  # [BG]
    w = tl.exp(m - tl.where(top == float("-inf"), 0.0, top)[None, :])  # [BS, BG]
    part = tl.load(PART + ((base[:, None] * PG + g[None, :]) * BD)[:, :, None]
                   + d[None, None, :], mask=sm[:, None, None], other=0.0)  # [BS, BG, BD]
    total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, :, None] * part, axis=0) / tl.where(total > 0, total, 1.0)[:, None]
    heads = kv_heads * G
    tl.store(OUT + (row * heads + h * G + g)[:, None] * D + d[None, :],
             out.to(OUT.dtype.element_ty), mask=(g < G)[:, None] & (d < D)[None, :])
