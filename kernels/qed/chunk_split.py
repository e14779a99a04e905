r"""Alternative intra-chunk stage of ``qed_chunk`` in two launches with short dependency chains
(``INTRA_IMPL = "split"`` in ``chunk.py``; the default ``"fused"`` is ``chunk_intra.py``).

The fused intra kernel runs one program per chunk and head through ~300 dependent steps
(cross-warp row reductions, the 16-step substitutions): latency bound on an H200 (4.3 ms at
B=8, T=4096, H=16, K=V=128). This split gives the same results with more, shorter programs:

* ``qed_rows_kernel``, one program per 16-token row block of a chunk (4x the programs): its
  rows of ``A_qk``, ``A_dk``, ``A_kk`` (``[16, 64]``, the same reference-point / exact-diagonal
  rules as ``chunk_intra``) and its tokens' ``kg``, ``qg``, ``a e^G`` (to ``AE``, compute dtype),
  ``dg`` and the probes rho, e, d.
* ``qed_solve_kernel``, one program per chunk: the four 16x16 diagonal blocks of
  ``I + A_kk`` inverted together (a ``[4, 16, 16]`` forward substitution, rows read from the
  scratch), then ``Ai = (I - N)(I + N^2) D^{-1}`` with ``D`` the block diagonal and
  ``N = D^{-1} L_off`` (``N^4 = 0``: four blocks), then ``W = Ai (a e^G)`` and ``U = Ai (w v)``.

Not yet timed on a GPU (written after this session's device time was spent): bench/kernels.py
times both implementations side by side.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .chunk_intra import _diag_exact, _put, _recon, _row, _scalars, _stats, _tile


@triton.jit(do_not_specialize=['T'])
def qed_rows_kernel(
    q, k, g, b, lam, z, d_in,
    KG, QG, AE, DG, AQK, ADK, AKK, GL, RHO, EIG, DPR,
    cu_seqlens, chunk_indices, T, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr,
    NK: tl.constexpr, ARM: tl.constexpr, LAM_TOKEN: tl.constexpr, L2NORM: tl.constexpr,
    IS_VARLEN: tl.constexpr, PROBES: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
    SPAN: tl.constexpr,
):
    i_ci, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_c = i_ci // (BT // BC)
    I = i_ci % (BT // BC)
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
    if bos + i_t * BT + I * BC >= eos:
        return

    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    r_i = bos + i_t * BT + I * BC + o_c
    m_i = r_i < eos
    if LAM_TOKEN:
        l_i = tl.load(lam + r_i * H + i_h, mask=m_i, other=0.).to(DT)
    else:
        l_i = tl.zeros([BC], dtype=DT) + tl.load(lam + i_h).to(DT)
    q += i_h * K
    k += i_h * K
    b += i_h * K
    g += i_h * K
    d_in += i_h * K
    KG += i_h * K
    QG += i_h * K
    AE += i_h * K
    DG += i_h * K
    DPR += i_h * K
    AQK += i_h * BT
    ADK += i_h * BT
    AKK += i_h * BT

    # row scalars of this block; |k|^2 of every row of the chunk
    qq, kk, kq, bkk, kx = _stats(q, k, b, z, d_in, r_i, m_i, i_h, K, H, BC, BKS, NK, ARM, DT)
    rq_i, rk_i, c_i, rho_i, e_i = _scalars(qq, kk, kq, bkk, kx, l_i, ARM, L2NORM)
    if PROBES:
        tl.store(RHO + r_i * H + i_h, rho_i.to(RHO.dtype.element_ty), mask=m_i)
        tl.store(EIG + r_i * H + i_h, e_i.to(EIG.dtype.element_ty), mask=m_i)
    kk_f = tl.zeros([BT], dtype=DT)
    for i_k in range(NK):
        cols = i_k * BKS + tl.arange(0, BKS)
        b_k = _tile(k, rows, m_t, cols, cols < K, H * K, DT)
        kk_f += tl.sum(b_k * b_k, 1)
    if L2NORM:
        rk_f = 1. / tl.sqrt(kk_f + 1e-6)
    else:
        rk_f = kk_f * 0. + 1.

    accq = tl.zeros([BC, BT], dtype=DT)
    acck = tl.zeros([BC, BT], dtype=DT)
    accd = tl.zeros([BC, BT], dtype=DT)
    jm = (o_t < (I + 1) * BC)[:, None]
    for i_k in range(NK):
        cols = i_k * BKS + tl.arange(0, BKS)
        m_c = cols < K
        g_f = _tile(g, rows, m_t, cols, m_c, H * K, DT)
        G_f = tl.cumsum(g_f, 0)
        k_f = _tile(k, rows, m_t, cols, m_c, H * K, DT) * rk_f[:, None]
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
        # this block's per-token factors
        glast = tl.sum(g_f, 0)
        ex = tl.exp(G_i)
        _put(KG, bk * tl.exp(glast[None, :] - G_i), r_i, m_i, cols, m_c, H * K)
        _put(QG, bq * ex * scale, r_i, m_i, cols, m_c, H * K)
        _put(AE, ba * ex, r_i, m_i, cols, m_c, H * K)
        if PROBES:
            _put(DG, bd * ex, r_i, m_i, cols, m_c, H * K)
            _put(DPR, bd, r_i, m_i, cols, m_c, H * K)
        if I == 0:
            tl.store(GL + (i_g * H + i_h) * K + cols, tl.exp(glast).to(GL.dtype.element_ty), mask=m_c)

    ri = (I * BC + o_c)[:, None]
    accq = tl.where(ri >= o_t[None, :], accq, 0.) * scale
    acck = tl.where(ri > o_t[None, :], acck, 0.)
    mc = o_t < BT
    _put(AQK, accq, r_i, m_i, o_t, mc, H * BT)
    _put(AKK, acck, r_i, m_i, o_t, mc, H * BT)
    if PROBES:
        _put(ADK, tl.where(ri > o_t[None, :], accd, 0.), r_i, m_i, o_t, mc, H * BT)


@triton.jit(do_not_specialize=['T'])
def qed_solve_kernel(
    v, w, AE, AKK, W, U,
    cu_seqlens, chunk_indices, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, BVS: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
):
    i_c, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        i_t = i_c
        bos = i_b * T
        eos = bos + T
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    o_b = tl.arange(0, BT // BC)
    t0 = bos + i_t * BT
    rows = t0 + o_t
    m_t = rows < eos
    AKK += i_h * BT
    blk_r = o_t[:, None] // BC
    blk_c = o_t[None, :] // BC
    p_full = AKK + rows[:, None] * (H * BT) + o_t[None, :]
    L_off = tl.load(p_full, mask=m_t[:, None] & (blk_c < blk_r), other=0.).to(DT)

    # the four diagonal blocks of (I + A_kk)^{-1} at once: X[b] = (I + A_bb)^{-1}
    eye = (o_c[:, None] == o_c[None, :]).to(DT)
    X = tl.zeros([BT // BC, BC, BC], dtype=DT) + eye[None, :, :]
    p_row = AKK + (t0 + o_b[:, None] * BC) * (H * BT) + o_b[:, None] * BC + o_c[None, :]
    for i in range(1, BC):
        m_row = ((t0 + o_b[:, None] * BC + i) < eos) & (o_c[None, :] < i)
        a = tl.load(p_row + i * (H * BT), mask=m_row, other=0.).to(DT)
        row = tl.sum(a[:, :, None] * X, 1)
        X = tl.where(o_c[None, :, None] == i, X - row[:, None, :], X)
    tl.debug_barrier()
    r3 = t0 + o_b[:, None, None] * BC + o_c[None, :, None]
    p_d = AKK + r3 * (H * BT) + o_b[:, None, None] * BC + o_c[None, None, :]
    tl.store(p_d, X.to(AKK.dtype.element_ty), mask=r3 < eos)
    tl.debug_barrier()
    Dinv = tl.load(p_full, mask=m_t[:, None] & (blk_c == blk_r), other=0.).to(DT)
    # (D + L_off)^{-1} = (I + N)^{-1} D^{-1}, N = D^{-1} L_off strictly block-lower, N^4 = 0
    N = tl.dot(Dinv, L_off, input_precision=SOLVE_PREC)
    N2 = tl.dot(N, N, input_precision=SOLVE_PREC)
    eye_t = (o_t[:, None] == o_t[None, :]).to(DT)
    Pm = eye_t - N + N2 - tl.dot(N, N2, input_precision=SOLVE_PREC)
    Ai = tl.dot(Pm, Dinv, input_precision=SOLVE_PREC)

    AE += i_h * K
    W += i_h * K
    for i_k in range(NK):
        cols = i_k * BKS + tl.arange(0, BKS)
        m_c = cols < K
        ae = _tile(AE, rows, m_t, cols, m_c, H * K, DT)
        _put(W, tl.dot(Ai, ae, input_precision=PREC), rows, m_t, cols, m_c, H * K)
    v += i_h * V
    w += i_h * V
    U += i_h * V
    for i_v in range(NV):
        cols = i_v * BVS + tl.arange(0, BVS)
        m_c = cols < V
        wv = _tile(v, rows, m_t, cols, m_c, H * V, DT) * _tile(w, rows, m_t, cols, m_c, H * V, DT)
        _put(U, tl.dot(Ai, wv, input_precision=PREC), rows, m_t, cols, m_c, H * V)
