"""The Triton kernels of models/causal/paged_attention.py: `split` attends one share of a (row,
KV head)'s keys, gathered through the row's block table, or all of them (applying Llama's RoPE
to q and the new key as it loads them, where asked); `merge` combines a row's shares. Imported
only where paged_attention uses them (it imports Triton).
"""

import triton
import triton.language as tl


# one compilation for every table width: a share size or table stride is never specialized on
@triton.jit(do_not_specialize=["chunk", "shares", "st_b"])
def split(Q, KN, VN, CK, CV, TABLE, LENS, OUT, PART, STAT, COS, SIN, scale, chunk, shares,
          sq_b, sq_h, sq_d, sk_b, sk_h, sk_d, sv_b, sv_h, sv_d,
          sc_blk, sc_h, sc_n, sc_d, st_b, st_n, scos_b,
          G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
          BN: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr):
    # ROPE: q and the new key arrive before Llama's RoPE, applied here as they load; COS, SIN
    # [b, D] rows (stride scos_b) in q's dtype
    # 64-bit offsets: a block's index times its size can pass 2**31 elements in a large cache
    row, h, s = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    length = tl.load(LENS + row)  # keys of this row, the new one included
    lo = s * chunk
    if lo >= length:  # this share lies past the row's keys: no loads, no stores
        return
    hi = tl.minimum(lo + chunk, length)
    g, d = tl.arange(0, BG), tl.arange(0, BD)
    gm, dm = g < G, d < D
    q_at = Q + row * sq_b + (h * G + g)[:, None] * sq_h
    q = tl.load(q_at + d[None, :] * sq_d, mask=gm[:, None] & dm[None, :],
                other=0.0)  # [BG, BD], rows past G zero
    k_new = tl.load(KN + row * sk_b + h * sk_h + d * sk_d, mask=dm, other=0.0)
    if ROPE:  # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1)
        first = d < D // 2
        turn = tl.where(first, d + D // 2, d - D // 2)
        c = tl.load(COS + row * scos_b + d, mask=dm, other=0.0).to(tl.float32)
        s_ = tl.load(SIN + row * scos_b + d, mask=dm, other=0.0).to(tl.float32)
        q = _rotated(q, tl.load(q_at + turn[None, :] * sq_d, mask=gm[:, None] & dm[None, :],
                                other=0.0), c[None, :], s_[None, :], first[None, :])
        k_new = _rotated(k_new, tl.load(KN + row * sk_b + h * sk_h + turn * sk_d, mask=dm,
                                        other=0.0), c, s_, first)
    q = (q.to(tl.float32) * scale).to(CK.dtype.element_ty)
    table = TABLE + row * st_b
    pos = length - 1  # the new key's position
    v_new = tl.load(VN + row * sv_b + h * sv_h + d * sv_d, mask=dm, other=0.0)
    k_new, v_new = k_new.to(CK.dtype.element_ty), v_new.to(CV.dtype.element_ty)
    if s == 0:
        written = tl.load(table + (pos // BLOCK) * st_n).to(tl.int64)
        at = written * sc_blk + h * sc_h + (pos % BLOCK) * sc_n + d * sc_d
        tl.store(CK + at, k_new, mask=dm)
        tl.store(CV + at, v_new, mask=dm)
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    n = lo + tl.arange(0, BN)
    block = tl.load(table + (n // BLOCK) * st_n, mask=n < hi, other=0).to(tl.int64)
    for start in range(lo, hi, BN):  # the row's own keys only: cost follows its length
        n = start + tl.arange(0, BN)
        inside = n < hi
        kv_at = (block * sc_blk + h * sc_h + (n % BLOCK) * sc_n)[:, None] + d[None, :] * sc_d
        # the next tile's blocks, read a tile ahead: a tile's key loads never wait on the table
        nxt = n + BN
        block = tl.load(table + (nxt // BLOCK) * st_n, mask=nxt < hi, other=0).to(tl.int64)
        both = inside[:, None] & dm[None, :]
        k = tl.load(CK + kv_at, mask=both, other=0.0)  # [BN, BD]
        v = tl.load(CV + kv_at, mask=both, other=0.0)
        # the new key from the step's own k and v: no wait on the program that writes it
        here = (n == pos)[:, None]
        k = tl.where(here, k_new[None, :], k)
        v = tl.where(here, v_new[None, :], v)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BG, BN] float32
        scores = tl.where(inside[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)  # every tile holds a key of the row: m_new is finite
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if length <= chunk:  # the row's keys fit this one share: the answer, into out [b, 1, heads, D]
        out = acc / l_i[:, None]
        heads = tl.num_programs(1) * G
        tl.store(OUT + (row * heads + h * G + g)[:, None] * D + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=gm[:, None] & dm[None, :])
    else:  # part [b, kv_heads, shares, BG, BD], stat [b, kv_heads, shares, 2, BG]
        base = (row * tl.num_programs(1) + h) * shares + s
        tl.store(PART + (base * BG + g)[:, None] * BD + d[None, :], acc)
        tl.store(STAT + (base * 2) * BG + g, m_i)
        tl.store(STAT + (base * 2 + 1) * BG + g, l_i)


@triton.jit
def _rotated(x, partner, c, s, first):
    # models/causal/fused_kernels.rope's arithmetic: each product rounded to x's dtype on its
    # own (a float16/bfloat16 x: no multiply-add can fuse across the rounding), as eager's are
    a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    b = (partner.to(tl.float32) * s).to(x.dtype).to(tl.float32)
    return tl.where(first, a - b, a + b).to(x.dtype)


@triton.jit(do_not_specialize=["chunk", "shares"])
def merge(OUT, PART, STAT, LENS, chunk, shares, G: tl.constexpr, BG: tl.constexpr,
          PG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr):
    # PG: the rows per share the split kernel wrote; BG: the real ones, to a power of two
    row, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    length = tl.load(LENS + row)
    if length <= chunk:  # one share held the row's keys and wrote the answer itself
        return
    active = (length + chunk - 1) // chunk  # the shares that attended
    kv_heads = tl.num_programs(1)
    s, g, d = tl.arange(0, BS), tl.arange(0, BG), tl.arange(0, BD)
    sm = s < active
    base = (row * kv_heads + h) * shares + s  # [BS]
    m = tl.load(STAT + (base * 2)[:, None] * PG + g[None, :], mask=sm[:, None],
                other=float("-inf"))  # [BS, BG]
    l = tl.load(STAT + (base * 2 + 1)[:, None] * PG + g[None, :], mask=sm[:, None],
                other=0.0)
    top = tl.max(m, axis=0)  # [BG], finite: share 0 always attended
    w = tl.exp(m - top[None, :])  # [BS, BG]
    part = tl.load(PART + ((base[:, None] * PG + g[None, :]) * BD)[:, :, None]
                   + d[None, None, :], mask=sm[:, None, None], other=0.0)  # [BS, BG, BD]
    total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, :, None] * part, axis=0) / total[:, None]
    heads = kv_heads * G
    tl.store(OUT + (row * heads + h * G + g)[:, None] * D + d[None, :],
             out.to(OUT.dtype.element_ty), mask=(g < G)[:, None] & (d < D)[None, :])
