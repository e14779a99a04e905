r"""Intra-chunk kernels of ``qed_chunk``: per-token preparation, the chunk's score matrices,
the UT-transform inverse and the WY factors (see ``chunk.py`` for the algorithm).

Two launches, each with one program per chunk of ``BT = 64`` tokens and head; inputs are read
in slices of ``BKS`` key channels so that K up to 256 fits. ``G`` is the within-chunk inclusive
cumsum of ``g`` (per channel).

``qed_prep_kernel`` (token-parallel work, reductions only along K except one cumsum per slice):

1. row statistics over all of K: ``|q|^2, |k|^2, q.k, sum b k^2`` and ``k.X`` (``X`` the arm's
   unprojected direction); from them the per-row scalars ``rq, rk`` (L2-norm factors) and ``c``
   (projection coefficient), written to ``RQ, RK, CP`` (``[B, T, H]``), and the probes ``rho, e``.
2. per key slice: ``G`` (written to the scratch ``GC``, ``[B, T, H, K]``), ``kg = k exp(G_last - G)``,
   ``qg = scale q exp(G)``, the chunk decay ``exp(G_last)``; probes: ``d`` and ``dg = d exp(G)``.

``qed_solve_kernel`` (reads rows of ``G``, the row scalars and rows of ``A_kk`` from memory, so
no value is pulled out of a register tile by a reduction along the token axis):

3. per row block of 16 tokens, one ``[16, 64]`` row of each score matrix: ``A_kk`` (strict, to
   the scratch ``AKK``, ``[B, T, H, BT]``), ``A_qk`` (inclusive, scaled), ``A_dk`` (strict,
   probes only), ``A_xk[t, j] = sum_c x_{t,c} exp(G_{t,c} - G_{j,c}) k_{j,c}``. The reference
   point is the block's first row ``s``: ``x_t e^{G_t - G_s}`` and ``k_j e^{G_s - G_j}``; for
   earlier blocks both factors are <= 1 (never overflow); the diagonal block uses the same
   product when its decay span (max over the block's rows and all K) is at most ``SPAN_MAX``
   nats, otherwise exact per-element exponentials.
4. ``Ai = (I + A_kk)^{-1}``: the four ``16 x 16`` diagonal blocks at once by forward
   substitution on a ``[4, 16, 16]`` tile (row ``i`` = ``e_i - sum_{m<i} A[i, m] row m``, the
   rows of ``A`` loaded from the scratch: 15 dependent steps), then the off-diagonal blocks by
   block products; written back over ``A_kk``.
5. ``W = Ai (a exp(G))`` and ``U = Ai (w v)``.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from .chunk_common import _put, _tile, channel_slice, chunk_position, shifted

# Arm codes shared with chunk.py.
ARM_CODES = {"gdn2": 0, "nogate_noproj": 1, "nogate": 2, "full": 3, "rand": 4, "noproj": 5}
ARM_GIVEN_D = 6
SPAN_MAX = 30.0
"""Largest within-sub-block decay span (nats) for which a diagonal block uses the reference-point
product; beyond it the block is built from exact per-element exponentials."""


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
        cols, m_c = channel_slice(i_k, BKS, K)
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


def _timing(kernel_call, quantiles):
    """Autotuner timing; the interpreter (CPU tests) times nothing and so runs the first config."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return [0., 0., 0.]
    return triton.testing.do_bench(kernel_call, quantiles=quantiles)


@triton.jit
def _row_lam(lam, r, m, H: tl.constexpr, LAM_TOKEN: tl.constexpr, DT: tl.constexpr):
    """lambda of rows ``r`` (mask ``m``) of one head: per token ``lam[r * H]``, or the head's ``lam[0]``."""
    if LAM_TOKEN:
        out = tl.load(lam + r * H, mask=m, other=0.).to(DT)
    else:
        out = tl.zeros_like(r).to(DT) + tl.load(lam).to(DT)
    return out


@triton.jit
def _row_scalars(RQ, RK, CP, lam, r, m, H: tl.constexpr, LAM_TOKEN: tl.constexpr, DT: tl.constexpr):
    """The per-row scalars the prep kernel stored (``rq, rk, c``) and lambda, for rows ``r``."""
    rq = tl.load(RQ + r * H, mask=m, other=0.).to(DT)
    rk = tl.load(RK + r * H, mask=m, other=0.).to(DT)
    c = tl.load(CP + r * H, mask=m, other=0.).to(DT)
    return rq, rk, c, _row_lam(lam, r, m, H, LAM_TOKEN, DT)


@triton.jit(do_not_specialize=['T'])
def qed_prep_kernel(
    q, k, b, g, lam, z, d_in,
    RQ, RK, CP, GC, KG, QG, DG, GL, RHO, EIG, DPR,
    cu_seqlens, chunk_indices, T, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr, NK: tl.constexpr,
    ARM: tl.constexpr, LAM_TOKEN: tl.constexpr, L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr,
    PROBES: tl.constexpr, DT: tl.constexpr,
):
    i_h, i_t, i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    rows = bos + i_t * BT + tl.arange(0, BT)
    m_t = rows < eos
    lam_f = _row_lam(lam + i_h, rows, m_t, H, LAM_TOKEN, DT)
    q, k, b, g, d_in = shifted((q, k, b, g, d_in), i_h * K)

    # ---- 1: row statistics over all of K, per-row scalars, probes rho and e
    qq, kk, kq, bkk, kx = _stats(q, k, b, z, d_in, rows, m_t, i_h, K, H, BT, BKS, NK, ARM, DT)
    rq, rk, c, rho, e = _scalars(qq, kk, kq, bkk, kx, lam_f, ARM, L2NORM)
    tl.store(RQ + rows * H + i_h, rq.to(RQ.dtype.element_ty), mask=m_t)
    tl.store(RK + rows * H + i_h, rk.to(RK.dtype.element_ty), mask=m_t)
    tl.store(CP + rows * H + i_h, c.to(CP.dtype.element_ty), mask=m_t)
    if PROBES:
        tl.store(RHO + rows * H + i_h, rho.to(RHO.dtype.element_ty), mask=m_t)
        tl.store(EIG + rows * H + i_h, e.to(EIG.dtype.element_ty), mask=m_t)

    # ---- 2: G (once per slice), kg, qg, (dg, d), chunk decay e^{G_last}
    GC, KG, QG, DG, DPR = shifted((GC, KG, QG, DG, DPR), i_h * K)
    for i_k in range(NK):
        cols, m_c = channel_slice(i_k, BKS, K)
        bq, bk, _, bd = _recon(q, k, b, z, d_in, rows, m_t, cols, m_c, i_h, rq, rk, c, lam_f, K, H, ARM, DT)
        g_f = _tile(g, rows, m_t, cols, m_c, H * K, DT)
        G_f = tl.cumsum(g_f, 0)
        glast = tl.sum(g_f, 0)
        ex = tl.exp(G_f)
        _put(GC, G_f, rows, m_t, cols, m_c, H * K)
        _put(KG, bk * tl.exp(glast[None, :] - G_f), rows, m_t, cols, m_c, H * K)
        _put(QG, bq * ex * scale, rows, m_t, cols, m_c, H * K)
        tl.store(GL + (i_g * H + i_h) * K + cols, tl.exp(glast).to(GL.dtype.element_ty), mask=m_c)
        if PROBES:
            _put(DG, bd * ex, rows, m_t, cols, m_c, H * K)
            _put(DPR, bd, rows, m_t, cols, m_c, H * K)


@triton.jit
def _diag_exact(k, GC, RK, bq, ba, bd, G_i, m_i, r_s, eos, cols, cq, ck, cd, off, K,
                H: tl.constexpr, PROBES: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, DT: tl.constexpr):
    """Columns ``off .. off+BC-1`` (the diagonal block) from exact per-element exponentials;
    key row ``j`` and its ``G`` are read from memory."""
    r = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    for j in range(BC):
        m_j = cols < K * (r_s + j < eos).to(tl.int32)  # a tensor mask (tensor & scalar is refused)
        kj = tl.load(k + (r_s + j) * (H * K) + cols, mask=m_j, other=0.).to(DT)
        kj *= tl.load(RK + (r_s + j) * H, mask=r_s + j < eos, other=0.).to(DT)
        gj = tl.load(GC + (r_s + j) * (H * K) + cols, mask=m_j, other=0.).to(DT)
        ke = tl.exp(tl.where((r[:, None] >= j) & m_i[:, None], G_i - gj[None, :], 0.)) * kj[None, :]
        sel = o_t[None, :] == off + j
        cq = tl.where(sel, tl.sum(bq * ke, 1)[:, None], cq)
        ck = tl.where(sel, tl.sum(ba * ke, 1)[:, None], ck)
        if PROBES:
            cd = tl.where(sel, tl.sum(bd * ke, 1)[:, None], cd)
    return cq, ck, cd


@triton.jit
def _scores(q, k, b, z, d_in, lam, GC, RQ, RK, CP, AQK, ADK, AKK, c0, eos, i_h, scale, I: tl.constexpr,
            K, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr, NK: tl.constexpr,
            ARM: tl.constexpr, LAM_TOKEN: tl.constexpr, PROBES: tl.constexpr, DT: tl.constexpr,
            PREC: tl.constexpr, SPAN: tl.constexpr):
    """Row block ``I`` (16 tokens from row ``c0 + I * BC``) of A_qk, A_dk (stored) and A_kk (to
    the scratch). ``GC, RQ, RK, CP`` as written by ``qed_prep_kernel``; pointers offset to the head."""
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    rows = c0 + o_t
    jm = (o_t < (I + 1) * BC) & (rows < eos)   # key rows this block reads
    r_s = c0 + I * BC                           # reference row
    r_e = tl.minimum(r_s + BC - 1, eos - 1)     # last valid row of the block
    r_i = r_s + o_c
    m_i = r_i < eos
    rq_i, rk_i, c_i, l_i = _row_scalars(RQ, RK, CP, lam, r_i, m_i, H, LAM_TOKEN, DT)
    rk_f = tl.load(RK + rows * H, mask=jm, other=0.).to(DT)
    k_lim = K * (r_s < eos).to(tl.int32)       # key columns of the reference row: K, or 0 past the end
    span = tl.zeros([BKS], dtype=DT)  # the block's decay span, max over all K (one reduction)
    for i_k in range(NK):
        cols = i_k * BKS + tl.arange(0, BKS)
        m_s = cols < k_lim
        span = tl.maximum(span, tl.load(GC + r_s * (H * K) + cols, mask=m_s, other=0.).to(DT)
                          - tl.load(GC + r_e * (H * K) + cols, mask=m_s, other=0.).to(DT))
    exact = tl.max(span, 0) > SPAN
    accq = tl.zeros([BC, BT], dtype=DT)
    acck = tl.zeros([BC, BT], dtype=DT)
    accd = tl.zeros([BC, BT], dtype=DT)
    for i_k in range(NK):
        cols, m_c = channel_slice(i_k, BKS, K)
        m_s = cols < k_lim
        gs = tl.load(GC + r_s * (H * K) + cols, mask=m_s, other=0.).to(DT)
        G_f = _tile(GC, rows, jm, cols, m_c, H * K, DT)
        k_f = _tile(k, rows, jm, cols, m_c, H * K, DT) * rk_f[:, None]
        G_i = _tile(GC, r_i, m_i, cols, m_c, H * K, DT)
        bq, _, ba, bd = _recon(q, k, b, z, d_in, r_i, m_i, cols, m_c, 0, rq_i, rk_i, c_i, l_i, K, H, ARM, DT)
        e1 = tl.where(m_i[:, None], tl.exp(G_i - gs[None, :]), 0.)
        kr = tl.trans(tl.where(jm[:, None], k_f * tl.exp(tl.minimum(gs[None, :] - G_f, 80.)), 0.))
        cq = tl.dot(bq * e1, kr, input_precision=PREC)
        ck = tl.dot(ba * e1, kr, input_precision=PREC)
        if PROBES:
            cd = tl.dot(bd * e1, kr, input_precision=PREC)
        else:
            cd = ck
        if exact:
            cq, ck, cd = _diag_exact(k, GC, RK, bq, ba, bd, G_i, m_i, r_s, eos, cols, cq, ck, cd,
                                     I * BC, K, H, PROBES, BC, BT, DT)
        accq += cq
        acck += ck
        if PROBES:
            accd += cd
    ri = (I * BC + o_c)[:, None]
    mc = o_t < BT
    _put(AQK, tl.where(ri >= o_t[None, :], accq, 0.) * scale, r_i, m_i, o_t, mc, H * BT)
    _put(AKK, tl.where(ri > o_t[None, :], acck, 0.), r_i, m_i, o_t, mc, H * BT)
    if PROBES:
        _put(ADK, tl.where(ri > o_t[None, :], accd, 0.), r_i, m_i, o_t, mc, H * BT)


@triton.jit
def _inv_diag(AKK, c0, eos, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr):
    """``(I + A_JJ)^{-1}`` of the ``BT // BC`` diagonal blocks of the strictly lower ``A_kk`` (in the
    scratch) as one ``[BT // BC, BC, BC]`` tile, by forward substitution over the block rows."""
    o_b = tl.arange(0, BT // BC)
    o_c = tl.arange(0, BC)
    eye = tl.where(o_c[:, None] == o_c[None, :], 1., 0.).to(DT)
    X = tl.zeros([BT // BC, BC, BC], dtype=DT) + eye[None, :, :]
    for i in tl.static_range(1, BC):
        r = c0 + o_b * BC + i
        a = tl.load(AKK + r[:, None] * (H * BT) + (o_b * BC)[:, None] + o_c[None, :],
                    mask=(r < eos)[:, None] & (o_c < i)[None, :], other=0.).to(DT)
        X = tl.where((o_c == i)[None, :, None], X - tl.sum(a[:, :, None] * X, 1)[:, None, :], X)
    return X


@triton.jit
def _blk(A, r0, eos, I: tl.constexpr, J: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
         DT: tl.constexpr):
    """Block ``(I, J)`` (``BC x BC``) of a ``[BT, BT]`` per-chunk matrix starting at row ``r0``."""
    rows = r0 + I * BC + tl.arange(0, BC)
    cols = J * BC + tl.arange(0, BC)
    return _tile(A, rows, rows < eos, cols, cols < BT, H * BT, DT)


@triton.jit
def _set(A, x, r0, eos, I: tl.constexpr, J: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    rows = r0 + I * BC + tl.arange(0, BC)
    cols = J * BC + tl.arange(0, BC)
    _put(A, x, rows, rows < eos, cols, cols < BT, H * BT)


@triton.autotune(configs=[triton.Config({}, num_warps=nw, num_stages=1) for nw in (8, 4)],
                 key=["K", "V", "BT", "PROBES"], do_bench=_timing)
@triton.jit(do_not_specialize=['T'])
def qed_solve_kernel(
    q, k, v, b, w, lam, z, d_in, GC, RQ, RK, CP,
    W, U, AQK, ADK, AKK,
    cu_seqlens, chunk_indices, T, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr, BVS: tl.constexpr,
    NK: tl.constexpr, NV: tl.constexpr,
    ARM: tl.constexpr, LAM_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr,
    PROBES: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, SPAN: tl.constexpr,
):
    i_h, i_t, _i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    c0 = bos + i_t * BT
    o_t = tl.arange(0, BT)
    rows = c0 + o_t
    m_t = rows < eos

    q, k, b, d_in, z, GC = shifted((q, k, b, d_in, z, GC), i_h * K)
    RQ, RK, CP = shifted((RQ, RK, CP), i_h)
    AQK, ADK, AKK = shifted((AQK, ADK, AKK), i_h * BT)
    lam += i_h

    # ---- 3: score rows, one block of 16 tokens at a time
    for I in tl.static_range(BT // BC):
        _scores(q, k, b, z, d_in, lam, GC, RQ, RK, CP, AQK, ADK, AKK, c0, eos, i_h, scale, I, K, H, BT, BC,
                BKS, NK, ARM, LAM_TOKEN, PROBES, DT, PREC, SPAN)
    tl.debug_barrier()

    # ---- 4: Ai = (I + A_kk)^{-1}: diagonal blocks by substitution, the rest by block products
    X = _inv_diag(AKK, c0, eos, H, BT, BC, DT)
    tl.debug_barrier()
    o_b = tl.arange(0, BT // BC)
    o_c = tl.arange(0, BC)
    r3 = c0 + o_b[:, None, None] * BC + o_c[None, :, None]
    c3 = o_b[:, None, None] * BC + o_c[None, None, :]
    tl.store(AKK + r3 * (H * BT) + c3, X.to(AKK.dtype.element_ty), mask=(r3 < eos) & (c3 < BT))
    tl.debug_barrier()
    i00 = _blk(AKK, c0, eos, 0, 0, H, BT, BC, DT)
    i11 = _blk(AKK, c0, eos, 1, 1, H, BT, BC, DT)
    i22 = _blk(AKK, c0, eos, 2, 2, H, BT, BC, DT)
    i33 = _blk(AKK, c0, eos, 3, 3, H, BT, BC, DT)
    k10 = _blk(AKK, c0, eos, 1, 0, H, BT, BC, DT)
    k20 = _blk(AKK, c0, eos, 2, 0, H, BT, BC, DT)
    k21 = _blk(AKK, c0, eos, 2, 1, H, BT, BC, DT)
    k30 = _blk(AKK, c0, eos, 3, 0, H, BT, BC, DT)
    k31 = _blk(AKK, c0, eos, 3, 1, H, BT, BC, DT)
    k32 = _blk(AKK, c0, eos, 3, 2, H, BT, BC, DT)
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
    _set(AKK, i10, c0, eos, 1, 0, H, BT, BC)
    _set(AKK, i20, c0, eos, 2, 0, H, BT, BC)
    _set(AKK, i21, c0, eos, 2, 1, H, BT, BC)
    _set(AKK, i30, c0, eos, 3, 0, H, BT, BC)
    _set(AKK, i31, c0, eos, 3, 1, H, BT, BC)
    _set(AKK, i32, c0, eos, 3, 2, H, BT, BC)
    tl.debug_barrier()
    lower = (o_t[None, :] // BC) <= (o_t[:, None] // BC)
    Ai = tl.load(AKK + rows[:, None] * (H * BT) + o_t[None, :], mask=m_t[:, None] & lower, other=0.).to(DT)

    # ---- 5: W = Ai (a e^G), U = Ai (w * v)
    rq, rk, c, lam_f = _row_scalars(RQ, RK, CP, lam, rows, m_t, H, LAM_TOKEN, DT)
    W += i_h * K
    for i_k in range(NK):
        cols, m_c = channel_slice(i_k, BKS, K)
        _, _, ba, _ = _recon(q, k, b, z, d_in, rows, m_t, cols, m_c, 0, rq, rk, c, lam_f, K, H, ARM, DT)
        ex = tl.exp(_tile(GC, rows, m_t, cols, m_c, H * K, DT))
        _put(W, tl.dot(Ai, ba * ex, input_precision=PREC), rows, m_t, cols, m_c, H * K)
    v, w, U = shifted((v, w, U), i_h * V)
    for i_v in range(NV):
        cols, m_c = channel_slice(i_v, BVS, V)
        wv = _tile(v, rows, m_t, cols, m_c, H * V, DT) * _tile(w, rows, m_t, cols, m_c, H * V, DT)
        _put(U, tl.dot(Ai, wv, input_precision=PREC), rows, m_t, cols, m_c, H * V)
