r"""Intra-chunk kernel of ``qed_chunk``: per-token preparation, the chunk's score matrices,
the UT-transform inverse and the WY factors (see ``chunk.py`` for the algorithm).

One program handles one chunk of ``BT = 64`` tokens of one head (row blocks of ``BC = 16``
rows for the score matrices). Inputs are read in slices of ``BKS`` key channels so that K up to
256 fits; a small scratch ``AKK`` ([B, T, H, BT], compute dtype) carries ``A_kk`` and then its
inverse between the row-block pass and the block inversion (same program, CTA barrier).

Passes, per chunk (``G`` = within-chunk inclusive cumsum of ``g``, per channel):

1. row statistics over all of K: ``|q|^2, |k|^2, q.k, sum b k^2`` and ``k.X`` (``X`` the arm's
   unprojected direction); from them per-row scalars (L2-norm factors, projection coefficient)
   and the probes ``rho`` and ``e``.
2. per row block of 16 tokens, one ``[16, 64]`` row of each score matrix: ``A_kk`` (strict),
   ``A_qk`` (inclusive, scaled), ``A_dk`` (strict, probes only), with
   ``A_xk[t, j] = sum_c x_{t,c} exp(G_{t,c} - G_{j,c}) k_{j,c}``. The reference point is the
   block's first row ``s``: ``x_t e^{G_t - G_s}`` and ``k_j e^{G_s - G_j}``; for earlier blocks
   both factors are <= 1 (never overflow); the diagonal block uses the same product when its
   decay span is at most ``SPAN_MAX`` nats, otherwise exact per-element exponentials.
3. ``Ai = (I + A_kk)^{-1}`` by forward substitution on the diagonal blocks and block products.
4. ``W = Ai (a * exp(G))``, ``kg = k exp(G_last - G)``, ``qg = scale q exp(G)``,
   ``dg = d exp(G)`` (probes), the chunk decay ``exp(G_last)``; then ``U = Ai (w * v)``.
"""
from __future__ import annotations

import triton
import triton.language as tl

# Arm codes shared with chunk.py.
ARM_CODES = {"gdn2": 0, "nogate_noproj": 1, "nogate": 2, "full": 3, "rand": 4, "noproj": 5}
ARM_GIVEN_D = 6
SPAN_MAX = 30.0
"""Largest within-sub-block decay span (nats) for which a diagonal block uses the reference-point
product; beyond it the block is built from exact per-element exponentials."""


@triton.jit
def _tile(ptr, rows, m_r, cols, m_c, stride, DT: tl.constexpr):
    return tl.load(ptr + rows[:, None] * stride + cols[None, :],
                   mask=m_r[:, None] & m_c[None, :], other=0.).to(DT)


@triton.jit
def _put(ptr, x, rows, m_r, cols, m_c, stride):
    tl.store(ptr + rows[:, None] * stride + cols[None, :], x.to(ptr.dtype.element_ty),
             mask=m_r[:, None] & m_c[None, :])


@triton.jit
def _row(x, i, BC: tl.constexpr):
    """Row ``i`` of a ``[BC, N]`` tile as an ``[N]`` vector."""
    r = tl.arange(0, BC)
    return tl.sum(tl.where(r[:, None] == i, x, 0.), 0)


@triton.jit
def _stats(q, k, b, z, dg_in, rows, m_r, i_h, K, H: tl.constexpr, BC: tl.constexpr,
           BKS: tl.constexpr, NK: tl.constexpr, ARM: tl.constexpr, DT: tl.constexpr):
    """Per-row sums over all K: |q|^2, |k|^2, q.k, sum b k^2, k.X (X: the arm's raw direction)."""
    qq = tl.zeros([BC], dtype=DT)
    kk = tl.zeros([BC], dtype=DT)
    kq = tl.zeros([BC], dtype=DT)
    bkk = tl.zeros([BC], dtype=DT)
    kx = tl.zeros([BC], dtype=DT)
    for i_k in range(NK):
        cols = i_k * BKS + tl.arange(0, BKS)
        m_c = cols < K
        b_q = _tile(q, rows, m_r, cols, m_c, H * K, DT)
        b_k = _tile(k, rows, m_r, cols, m_c, H * K, DT)
        b_b = _tile(b, rows, m_r, cols, m_c, H * K, DT)
        qq += tl.sum(b_q * b_q, 1)
        kk += tl.sum(b_k * b_k, 1)
        kq += tl.sum(b_k * b_q, 1)
        bkk += tl.sum(b_b * b_k * b_k, 1)
        if ARM == 3 or ARM == 5:
            kx += tl.sum(b_k * b_b * b_q, 1)
        elif ARM == 4:
            b_z = tl.load(z + i_h * K + cols, mask=m_c, other=0.).to(DT)
            kx += tl.sum(b_k * b_b * b_z[None, :], 1)
        elif ARM == 6:
            b_d = _tile(dg_in, rows, m_r, cols, m_c, H * K, DT)
            kx += tl.sum(b_k * b_d, 1)
    if ARM == 1 or ARM == 2:
        kx = kq
    return qq, kk, kq, bkk, kx


@triton.jit
def _scalars(qq, kk, kq, bkk, kx, lam_r, ARM: tl.constexpr, L2NORM: tl.constexpr):
    """Per-row factors: rq, rk (L2 norm), c (projection coefficient), rho and e."""
    if L2NORM:
        rq = 1. / tl.sqrt(qq + 1e-6)
        rk = 1. / tl.sqrt(kk + 1e-6)
    else:
        rq = qq * 0. + 1.
        rk = kk * 0. + 1.
    rho = kq * rq * rk
    if ARM == 1 or ARM == 2 or ARM == 3 or ARM == 5:
        kxh = kx * rk * rq
    else:
        kxh = kx * rk
    if ARM == 2 or ARM == 3 or ARM == 4:
        c = kxh
    else:
        c = kxh * 0.
    if ARM == 0:
        dk = kxh * 0.
    else:
        dk = kxh - c * (kk * rk * rk)
    e = 1. - bkk * rk * rk - lam_r * dk
    return rq, rk, c, rho, e


@triton.jit
def _recon(q, k, b, z, dg_in, rows, m_r, cols, m_c, i_h, rq, rk, c, lam_r, K, H: tl.constexpr,
           ARM: tl.constexpr, DT: tl.constexpr):
    """Normalised q, k and the direction d and erase vector a on one [BC, BKS] slice."""
    b_q = _tile(q, rows, m_r, cols, m_c, H * K, DT) * rq[:, None]
    b_k = _tile(k, rows, m_r, cols, m_c, H * K, DT) * rk[:, None]
    b_b = _tile(b, rows, m_r, cols, m_c, H * K, DT)
    if ARM == 1 or ARM == 2:
        b_x = b_q
    elif ARM == 3 or ARM == 5:
        b_x = b_b * b_q
    elif ARM == 4:
        b_z = tl.load(z + i_h * K + cols, mask=m_c, other=0.).to(DT)
        b_x = b_b * b_z[None, :]
    elif ARM == 6:
        b_x = _tile(dg_in, rows, m_r, cols, m_c, H * K, DT)
    else:
        b_x = b_q * 0.
    b_d = b_x - c[:, None] * b_k
    b_a = b_b * b_k + lam_r[:, None] * b_d
    return b_q, b_k, b_a, b_d


@triton.jit
def _gcum(g, rows, m_r, cols, m_c, K, carry, H: tl.constexpr, DT: tl.constexpr):
    """Inclusive cumsum of g over this sub-block, continuing from ``carry``; new carry."""
    b_g = _tile(g, rows, m_r, cols, m_c, H * K, DT)
    return tl.cumsum(b_g, 0) + carry[None, :], carry + tl.sum(b_g, 0)


@triton.jit
def _inv_diag(A, BC: tl.constexpr):
    """(I + A)^{-1} for strictly lower-triangular A [BC, BC] by forward substitution."""
    r = tl.arange(0, BC)
    X = tl.where(r[:, None] == r[None, :], 1., 0.).to(A.dtype)
    for i in tl.static_range(1, BC):
        a_i = _row(A, i, BC)
        row = tl.sum(a_i[:, None] * X, 0)
        X = tl.where(r[:, None] == i, X - row[None, :], X)
    return X


@triton.jit
def _sub(x, I: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr):
    """Entries ``I*BC .. I*BC+BC-1`` of a ``[BT]`` vector as a ``[BC]`` vector."""
    sel = (I * BC + tl.arange(0, BC))[:, None] == tl.arange(0, BT)[None, :]
    return tl.sum(tl.where(sel, x[None, :], 0.), 1)


@triton.jit
def _diag_exact(bq, ba, bd, bk, bG, cq, ck, cd, off, PROBES: tl.constexpr, BC: tl.constexpr,
                BT: tl.constexpr):
    """Columns ``off .. off+BC-1`` (the diagonal block) from exact per-element exponentials."""
    r = tl.arange(0, BC)
    cols = tl.arange(0, BT)
    for j in range(BC):
        kj = _row(bk, j, BC)
        gj = _row(bG, j, BC)
        ke = tl.exp(tl.where(r[:, None] >= j, bG - gj[None, :], 0.)) * kj[None, :]
        sel = cols[None, :] == off + j
        cq = tl.where(sel, tl.sum(bq * ke, 1)[:, None], cq)
        ck = tl.where(sel, tl.sum(ba * ke, 1)[:, None], ck)
        if PROBES:
            cd = tl.where(sel, tl.sum(bd * ke, 1)[:, None], cd)
    return cq, ck, cd


@triton.jit
def _row_block(q, k, b, g, z, d_in, rows, m_t, rq, rk, c, lam_f, AQK, ADK, AKK, bos, eos, i_t, i_h,
               scale, I: tl.constexpr, K, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
               BKS: tl.constexpr, NK: tl.constexpr, ARM: tl.constexpr, PROBES: tl.constexpr,
               DT: tl.constexpr, PREC: tl.constexpr, SPAN: tl.constexpr):
    """Row block ``I`` (16 tokens) of A_qk, A_dk (stored) and A_kk (to the scratch)."""
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    r_i = bos + i_t * BT + I * BC + o_c
    m_i = r_i < eos
    rq_i = _sub(rq, I, BC, BT)
    rk_i = _sub(rk, I, BC, BT)
    c_i = _sub(c, I, BC, BT)
    l_i = _sub(lam_f, I, BC, BT)
    accq = tl.zeros([BC, BT], dtype=DT)
    acck = tl.zeros([BC, BT], dtype=DT)
    accd = tl.zeros([BC, BT], dtype=DT)
    jm = (o_t < (I + 1) * BC)[:, None]
    for i_k in range(NK):
        cols = i_k * BKS + tl.arange(0, BKS)
        m_c = cols < K
        g_f = _tile(g, rows, m_t, cols, m_c, H * K, DT)
        G_f = tl.cumsum(g_f, 0)
        k_f = _tile(k, rows, m_t, cols, m_c, H * K, DT) * rk[:, None]
        bq, bk, ba, bd = _recon(q, k, b, z, d_in, r_i, m_i, cols, m_c, i_h, rq_i, rk_i, c_i, l_i, K, H, ARM, DT)
        prefix = tl.sum(tl.where(o_t[:, None] < I * BC, g_f, 0.), 0)
        G_i = tl.cumsum(_tile(g, r_i, m_i, cols, m_c, H * K, DT), 0) + prefix[None, :]
        gs = _row(G_i, 0, BC)
        e1 = tl.exp(G_i - gs[None, :])
        kr = tl.trans(tl.where(jm, k_f * tl.exp(tl.minimum(tl.where(jm, gs[None, :] - G_f, 0.), 80.)), 0.))
        cq = tl.dot(bq * e1, kr, input_precision=PREC)
        ck = tl.dot(ba * e1, kr, input_precision=PREC)
        if PROBES:
            cd = tl.dot(bd * e1, kr, input_precision=PREC)
        else:
            cd = ck
        span = tl.max(gs - _row(G_i, BC - 1, BC), 0)
        if span > SPAN:
            cq, ck, cd = _diag_exact(bq, ba, bd, bk, G_i, cq, ck, cd, I * BC, PROBES, BC, BT)
        accq += cq
        acck += ck
        if PROBES:
            accd += cd
    ri = (I * BC + o_c)[:, None]
    accq = tl.where(ri >= o_t[None, :], accq, 0.) * scale
    acck = tl.where(ri > o_t[None, :], acck, 0.)
    mc = o_t < BT
    _put(AQK, accq, r_i, m_i, o_t, mc, H * BT)
    _put(AKK, acck, r_i, m_i, o_t, mc, H * BT)
    if PROBES:
        _put(ADK, tl.where(ri > o_t[None, :], accd, 0.), r_i, m_i, o_t, mc, H * BT)


@triton.jit
def _blk(A, rows_i, m_i, J: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
         DT: tl.constexpr):
    cols = J * BC + tl.arange(0, BC)
    return _tile(A, rows_i, m_i, cols, cols < BT, H * BT, DT)


@triton.jit
def chunk_position(cu_seqlens, chunk_indices, T, H: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """This program's chunk, grid ``(chunks, B * H)`` (or ``(NC, H)`` with varlen):
    ``(i_h, i_t, i_g, bos, eos)`` = head, chunk within its sequence, global chunk index and the
    sequence's token span in the flattened ``B * T`` rows."""
    i_c, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        i_g = i_c
    else:
        i_t = i_c
        bos = i_b * T
        eos = bos + T
        i_g = i_b * tl.cdiv(T, BT) + i_t
    return i_h, i_t, i_g, bos, eos


@triton.jit(do_not_specialize=['T'])
def qed_intra_kernel(
    q, k, v, g, b, w, lam, z, d_in,
    W, U, KG, QG, DG, AQK, ADK, AKK, GL, RHO, EIG, DPR,
    cu_seqlens, chunk_indices, T, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr, BVS: tl.constexpr,
    NK: tl.constexpr, NV: tl.constexpr,
    ARM: tl.constexpr, LAM_TOKEN: tl.constexpr, L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr,
    PROBES: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, SPAN: tl.constexpr,
):
    i_h, i_t, i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)

    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    if LAM_TOKEN:
        lam_f = tl.load(lam + rows * H + i_h, mask=m_t, other=0.).to(DT)
    else:
        lam_f = tl.zeros([BT], dtype=DT) + tl.load(lam + i_h).to(DT)

    q += i_h * K
    k += i_h * K
    b += i_h * K
    g += i_h * K
    d_in += i_h * K
    AQK += i_h * BT
    ADK += i_h * BT
    AKK += i_h * BT

    # ---- pass 1: row statistics over all of K, per-row scalars, probes rho and e
    qq, kk, kq, bkk, kx = _stats(q, k, b, z, d_in, rows, m_t, i_h, K, H, BT, BKS, NK, ARM, DT)
    rq, rk, c, rho, e = _scalars(qq, kk, kq, bkk, kx, lam_f, ARM, L2NORM)
    if PROBES:
        tl.store(RHO + rows * H + i_h, rho.to(RHO.dtype.element_ty), mask=m_t)
        tl.store(EIG + rows * H + i_h, e.to(EIG.dtype.element_ty), mask=m_t)

    # ---- pass 2: score rows, one block of 16 tokens at a time
    for I in tl.static_range(BT // BC):
        _row_block(q, k, b, g, z, d_in, rows, m_t, rq, rk, c, lam_f, AQK, ADK, AKK, bos, eos, i_t,
                   i_h, scale, I, K, H, BT, BC, BKS, NK, ARM, PROBES, DT, PREC, SPAN)
    tl.debug_barrier()

    # ---- pass 3: Ai = (I + A_kk)^{-1}, blockwise; written back over A_kk
    r0 = bos + i_t * BT + o_c
    r1 = r0 + BC
    r2 = r0 + 2 * BC
    r3 = r0 + 3 * BC
    m0, m1, m2, m3 = r0 < eos, r1 < eos, r2 < eos, r3 < eos
    k00 = _blk(AKK, r0, m0, 0, H, BT, BC, DT)
    k10 = _blk(AKK, r1, m1, 0, H, BT, BC, DT)
    k11 = _blk(AKK, r1, m1, 1, H, BT, BC, DT)
    k20 = _blk(AKK, r2, m2, 0, H, BT, BC, DT)
    k21 = _blk(AKK, r2, m2, 1, H, BT, BC, DT)
    k22 = _blk(AKK, r2, m2, 2, H, BT, BC, DT)
    k30 = _blk(AKK, r3, m3, 0, H, BT, BC, DT)
    k31 = _blk(AKK, r3, m3, 1, H, BT, BC, DT)
    k32 = _blk(AKK, r3, m3, 2, H, BT, BC, DT)
    k33 = _blk(AKK, r3, m3, 3, H, BT, BC, DT)
    i00 = _inv_diag(k00, BC)
    i11 = _inv_diag(k11, BC)
    i22 = _inv_diag(k22, BC)
    i33 = _inv_diag(k33, BC)
    i10 = -tl.dot(i11, tl.dot(k10, i00, input_precision="ieee"), input_precision="ieee")
    i21 = -tl.dot(i22, tl.dot(k21, i11, input_precision="ieee"), input_precision="ieee")
    i32 = -tl.dot(i33, tl.dot(k32, i22, input_precision="ieee"), input_precision="ieee")
    i20 = -tl.dot(i22, tl.dot(k20, i00, input_precision="ieee")
                  + tl.dot(k21, i10, input_precision="ieee"), input_precision="ieee")
    i31 = -tl.dot(i33, tl.dot(k31, i11, input_precision="ieee")
                  + tl.dot(k32, i21, input_precision="ieee"), input_precision="ieee")
    i30 = -tl.dot(i33, tl.dot(k30, i00, input_precision="ieee")
                  + tl.dot(k31, i10, input_precision="ieee")
                  + tl.dot(k32, i20, input_precision="ieee"), input_precision="ieee")
    tl.debug_barrier()
    c0, c1, c2, c3 = o_c, o_c + BC, o_c + 2 * BC, o_c + 3 * BC
    mc = o_c < BC
    _put(AKK, i00, r0, m0, c0, mc, H * BT)
    _put(AKK, i10, r1, m1, c0, mc, H * BT)
    _put(AKK, i11, r1, m1, c1, mc, H * BT)
    _put(AKK, i20, r2, m2, c0, mc, H * BT)
    _put(AKK, i21, r2, m2, c1, mc, H * BT)
    _put(AKK, i22, r2, m2, c2, mc, H * BT)
    _put(AKK, i30, r3, m3, c0, mc, H * BT)
    _put(AKK, i31, r3, m3, c1, mc, H * BT)
    _put(AKK, i32, r3, m3, c2, mc, H * BT)
    _put(AKK, i33, r3, m3, c3, mc, H * BT)
    tl.debug_barrier()
    lower = (o_t[None, :] // BC) <= (o_t[:, None] // BC)
    Ai = tl.load(AKK + rows[:, None] * (H * BT) + o_t[None, :], mask=m_t[:, None] & lower, other=0.).to(DT)

    # ---- pass 4: W = Ai (a e^G), kg, qg, (dg, d), chunk decay e^{G_last}
    W += i_h * K
    KG += i_h * K
    QG += i_h * K
    DG += i_h * K
    DPR += i_h * K
    for i_k in range(NK):
        cols = i_k * BKS + tl.arange(0, BKS)
        m_c = cols < K
        bq, bk, ba, bd = _recon(q, k, b, z, d_in, rows, m_t, cols, m_c, i_h, rq, rk, c, lam_f, K, H, ARM, DT)
        g_f = _tile(g, rows, m_t, cols, m_c, H * K, DT)
        G_f = tl.cumsum(g_f, 0)
        glast = tl.sum(g_f, 0)
        ex = tl.exp(G_f)
        _put(W, tl.dot(Ai, ba * ex, input_precision=PREC), rows, m_t, cols, m_c, H * K)
        _put(KG, bk * tl.exp(glast[None, :] - G_f), rows, m_t, cols, m_c, H * K)
        _put(QG, bq * ex * scale, rows, m_t, cols, m_c, H * K)
        tl.store(GL + (i_g * H + i_h) * K + cols, tl.exp(glast).to(GL.dtype.element_ty), mask=m_c)
        if PROBES:
            _put(DG, bd * ex, rows, m_t, cols, m_c, H * K)
            _put(DPR, bd, rows, m_t, cols, m_c, H * K)

    # ---- pass 5: U = Ai (w * v)
    v += i_h * V
    w += i_h * V
    U += i_h * V
    for i_v in range(NV):
        cols = i_v * BVS + tl.arange(0, BVS)
        m_c = cols < V
        wv = _tile(v, rows, m_t, cols, m_c, H * V, DT) * _tile(w, rows, m_t, cols, m_c, H * V, DT)
        _put(U, tl.dot(Ai, wv, input_precision=PREC), rows, m_t, cols, m_c, H * V)
