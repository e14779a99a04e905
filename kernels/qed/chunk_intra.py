r"""Intra-chunk kernel of ``qed_chunk``: per-token preparation, the chunk's score matrices,
the UT-transform inverse and the WY factors (see ``chunk.py`` for the algorithm).

One program handles one chunk of ``BT = 64`` tokens of one head, as four sub-blocks of
``BC = 16`` rows. Inputs are read in slices of ``BKS`` key channels so that K up to 256 fits.

Passes, per chunk (``G`` = within-chunk inclusive cumsum of ``g``, per channel):

1. row statistics over all of K: ``|q|^2, |k|^2, q.k, sum b k^2`` and ``k.X`` (``X`` the arm's
   unprojected direction); from them per-row scalars (L2-norm factors, projection coefficient)
   and the probes ``rho`` and ``e``.
2. score blocks ``A_kk`` (strict), ``A_qk`` (inclusive, scaled), ``A_dk`` (strict, probes only),
   ``A_xk[t, j] = sum_c x_{t,c} exp(G_{t,c} - G_{j,c}) k_{j,c}``. Off-diagonal sub-blocks use the
   first row of the row block as reference point (both factors <= 1, never overflow); diagonal
   sub-blocks use that reference too when the block's decay span is small, otherwise exact
   per-element exponentials (any ``g <= 0`` is safe).
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
def _off(lq, la, ld, gs, b_k, b_G, PROBES: tl.constexpr, PREC: tl.constexpr):
    """Off-diagonal sub-block: rows already carry exp(G_t - gs), gs = first row of their block."""
    kr = tl.trans(b_k * tl.exp(gs[None, :] - b_G))
    aqk = tl.dot(lq, kr, input_precision=PREC)
    akk = tl.dot(la, kr, input_precision=PREC)
    if PROBES:
        adk = tl.dot(ld, kr, input_precision=PREC)
    else:
        adk = akk
    return aqk, akk, adk


@triton.jit
def _diag(b_q, b_a, b_d, b_k, b_G, gs, PROBES: tl.constexpr, BC: tl.constexpr,
          PREC: tl.constexpr, DT: tl.constexpr, SPAN: tl.constexpr):
    """Diagonal sub-block (unmasked): reference-point product when the decay span is small,
    exact per-element exponentials otherwise."""
    span = tl.max(gs - _row(b_G, BC - 1, BC), 0)
    if span <= SPAN:
        e1 = tl.exp(b_G - gs[None, :])
        kr = tl.trans(b_k * tl.exp(gs[None, :] - b_G))
        aqk = tl.dot(b_q * e1, kr, input_precision=PREC)
        akk = tl.dot(b_a * e1, kr, input_precision=PREC)
        if PROBES:
            adk = tl.dot(b_d * e1, kr, input_precision=PREC)
        else:
            adk = akk
    else:
        r = tl.arange(0, BC)
        aqk = tl.zeros([BC, BC], dtype=DT)
        akk = tl.zeros([BC, BC], dtype=DT)
        adk = tl.zeros([BC, BC], dtype=DT)
        for j in tl.static_range(BC):
            kj = _row(b_k, j, BC)
            gj = _row(b_G, j, BC)
            ke = tl.exp(tl.where(r[:, None] >= j, b_G - gj[None, :], 0.)) * kj[None, :]
            sel = r[None, :] == j
            aqk = tl.where(sel, tl.sum(b_q * ke, 1)[:, None], aqk)
            akk = tl.where(sel, tl.sum(b_a * ke, 1)[:, None], akk)
            if PROBES:
                adk = tl.where(sel, tl.sum(b_d * ke, 1)[:, None], adk)
    return aqk, akk, adk


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


@triton.jit(do_not_specialize=['T'])
def qed_intra_kernel(
    q, k, v, g, b, w, lam, z, d_in,
    W, U, KG, QG, DG, AQK, ADK, GL, RHO, EIG, DPR,
    cu_seqlens, chunk_indices, T, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr, BVS: tl.constexpr,
    NK: tl.constexpr, NV: tl.constexpr,
    ARM: tl.constexpr, LAM_TOKEN: tl.constexpr, L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr,
    PROBES: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, SPAN: tl.constexpr,
):
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

    o_r = tl.arange(0, BC)
    r0 = bos + i_t * BT + o_r
    r1 = r0 + BC
    r2 = r0 + 2 * BC
    r3 = r0 + 3 * BC
    m0, m1, m2, m3 = r0 < eos, r1 < eos, r2 < eos, r3 < eos

    if LAM_TOKEN:
        l0 = tl.load(lam + r0 * H + i_h, mask=m0, other=0.).to(DT)
        l1 = tl.load(lam + r1 * H + i_h, mask=m1, other=0.).to(DT)
        l2 = tl.load(lam + r2 * H + i_h, mask=m2, other=0.).to(DT)
        l3 = tl.load(lam + r3 * H + i_h, mask=m3, other=0.).to(DT)
    else:
        lh = tl.load(lam + i_h).to(DT)
        l0 = tl.zeros([BC], dtype=DT) + lh
        l1, l2, l3 = l0, l0, l0

    q += i_h * K
    k += i_h * K
    b += i_h * K
    g += i_h * K
    d_in += i_h * K

    # ---- pass 1: row statistics, per-row scalars, probes rho and e
    qq, kk, kq, bkk, kx = _stats(q, k, b, z, d_in, r0, m0, i_h, K, H, BC, BKS, NK, ARM, DT)
    rq0, rk0, c0, rho0, e0 = _scalars(qq, kk, kq, bkk, kx, l0, ARM, L2NORM)
    qq, kk, kq, bkk, kx = _stats(q, k, b, z, d_in, r1, m1, i_h, K, H, BC, BKS, NK, ARM, DT)
    rq1, rk1, c1, rho1, e1 = _scalars(qq, kk, kq, bkk, kx, l1, ARM, L2NORM)
    qq, kk, kq, bkk, kx = _stats(q, k, b, z, d_in, r2, m2, i_h, K, H, BC, BKS, NK, ARM, DT)
    rq2, rk2, c2, rho2, e2 = _scalars(qq, kk, kq, bkk, kx, l2, ARM, L2NORM)
    qq, kk, kq, bkk, kx = _stats(q, k, b, z, d_in, r3, m3, i_h, K, H, BC, BKS, NK, ARM, DT)
    rq3, rk3, c3, rho3, e3 = _scalars(qq, kk, kq, bkk, kx, l3, ARM, L2NORM)
    if PROBES:
        tl.store(RHO + r0 * H + i_h, rho0.to(RHO.dtype.element_ty), mask=m0)
        tl.store(RHO + r1 * H + i_h, rho1.to(RHO.dtype.element_ty), mask=m1)
        tl.store(RHO + r2 * H + i_h, rho2.to(RHO.dtype.element_ty), mask=m2)
        tl.store(RHO + r3 * H + i_h, rho3.to(RHO.dtype.element_ty), mask=m3)
        tl.store(EIG + r0 * H + i_h, e0.to(EIG.dtype.element_ty), mask=m0)
        tl.store(EIG + r1 * H + i_h, e1.to(EIG.dtype.element_ty), mask=m1)
        tl.store(EIG + r2 * H + i_h, e2.to(EIG.dtype.element_ty), mask=m2)
        tl.store(EIG + r3 * H + i_h, e3.to(EIG.dtype.element_ty), mask=m3)

    # ---- pass 2: score blocks, accumulated over key slices
    zb = tl.zeros([BC, BC], dtype=DT)
    q00, q10, q11, q20, q21, q22, q30, q31, q32, q33 = zb, zb, zb, zb, zb, zb, zb, zb, zb, zb
    k00, k10, k11, k20, k21, k22, k30, k31, k32, k33 = zb, zb, zb, zb, zb, zb, zb, zb, zb, zb
    d00, d10, d11, d20, d21, d22, d30, d31, d32, d33 = zb, zb, zb, zb, zb, zb, zb, zb, zb, zb
    for i_k in range(NK):
        cols = i_k * BKS + tl.arange(0, BKS)
        m_c = cols < K
        carry = tl.zeros([BKS], dtype=DT)
        # block 0
        bq0, bk0, ba0, bd0 = _recon(q, k, b, z, d_in, r0, m0, cols, m_c, i_h, rq0, rk0, c0, l0, K, H, ARM, DT)
        G0, carry = _gcum(g, r0, m0, cols, m_c, K, carry, H, DT)
        gs = _row(G0, 0, BC)
        x, y, u = _diag(bq0, ba0, bd0, bk0, G0, gs, PROBES, BC, PREC, DT, SPAN)
        q00 += x
        k00 += y
        d00 += u
        # block 1
        bq1, bk1, ba1, bd1 = _recon(q, k, b, z, d_in, r1, m1, cols, m_c, i_h, rq1, rk1, c1, l1, K, H, ARM, DT)
        G1, carry = _gcum(g, r1, m1, cols, m_c, K, carry, H, DT)
        gs = _row(G1, 0, BC)
        x, y, u = _diag(bq1, ba1, bd1, bk1, G1, gs, PROBES, BC, PREC, DT, SPAN)
        q11 += x
        k11 += y
        d11 += u
        ex = tl.exp(G1 - gs[None, :])
        lq, la, ld = bq1 * ex, ba1 * ex, bd1 * ex
        x, y, u = _off(lq, la, ld, gs, bk0, G0, PROBES, PREC)
        q10 += x
        k10 += y
        d10 += u
        # block 2
        bq2, bk2, ba2, bd2 = _recon(q, k, b, z, d_in, r2, m2, cols, m_c, i_h, rq2, rk2, c2, l2, K, H, ARM, DT)
        G2, carry = _gcum(g, r2, m2, cols, m_c, K, carry, H, DT)
        gs = _row(G2, 0, BC)
        x, y, u = _diag(bq2, ba2, bd2, bk2, G2, gs, PROBES, BC, PREC, DT, SPAN)
        q22 += x
        k22 += y
        d22 += u
        ex = tl.exp(G2 - gs[None, :])
        lq, la, ld = bq2 * ex, ba2 * ex, bd2 * ex
        x, y, u = _off(lq, la, ld, gs, bk0, G0, PROBES, PREC)
        q20 += x
        k20 += y
        d20 += u
        x, y, u = _off(lq, la, ld, gs, bk1, G1, PROBES, PREC)
        q21 += x
        k21 += y
        d21 += u
        # block 3
        bq3, bk3, ba3, bd3 = _recon(q, k, b, z, d_in, r3, m3, cols, m_c, i_h, rq3, rk3, c3, l3, K, H, ARM, DT)
        G3, carry = _gcum(g, r3, m3, cols, m_c, K, carry, H, DT)
        gs = _row(G3, 0, BC)
        x, y, u = _diag(bq3, ba3, bd3, bk3, G3, gs, PROBES, BC, PREC, DT, SPAN)
        q33 += x
        k33 += y
        d33 += u
        ex = tl.exp(G3 - gs[None, :])
        lq, la, ld = bq3 * ex, ba3 * ex, bd3 * ex
        x, y, u = _off(lq, la, ld, gs, bk0, G0, PROBES, PREC)
        q30 += x
        k30 += y
        d30 += u
        x, y, u = _off(lq, la, ld, gs, bk1, G1, PROBES, PREC)
        q31 += x
        k31 += y
        d31 += u
        x, y, u = _off(lq, la, ld, gs, bk2, G2, PROBES, PREC)
        q32 += x
        k32 += y
        d32 += u

    # masks of the diagonal blocks
    incl = o_r[:, None] >= o_r[None, :]
    strict = o_r[:, None] > o_r[None, :]
    q00 = tl.where(incl, q00, 0.) * scale
    q11 = tl.where(incl, q11, 0.) * scale
    q22 = tl.where(incl, q22, 0.) * scale
    q33 = tl.where(incl, q33, 0.) * scale
    k00 = tl.where(strict, k00, 0.)
    k11 = tl.where(strict, k11, 0.)
    k22 = tl.where(strict, k22, 0.)
    k33 = tl.where(strict, k33, 0.)
    # score matrices for the output (scaled) and, with probes, for Sd
    c_0 = o_r
    c_1 = o_r + BC
    c_2 = o_r + 2 * BC
    c_3 = o_r + 3 * BC
    mc = o_r < BC
    AQK += i_h * BT
    _put(AQK, q00, r0, m0, c_0, mc, H * BT)
    _put(AQK, q10 * scale, r1, m1, c_0, mc, H * BT)
    _put(AQK, q11, r1, m1, c_1, mc, H * BT)
    _put(AQK, q20 * scale, r2, m2, c_0, mc, H * BT)
    _put(AQK, q21 * scale, r2, m2, c_1, mc, H * BT)
    _put(AQK, q22, r2, m2, c_2, mc, H * BT)
    _put(AQK, q30 * scale, r3, m3, c_0, mc, H * BT)
    _put(AQK, q31 * scale, r3, m3, c_1, mc, H * BT)
    _put(AQK, q32 * scale, r3, m3, c_2, mc, H * BT)
    _put(AQK, q33, r3, m3, c_3, mc, H * BT)
    if PROBES:
        ADK += i_h * BT
        _put(ADK, tl.where(strict, d00, 0.), r0, m0, c_0, mc, H * BT)
        _put(ADK, d10, r1, m1, c_0, mc, H * BT)
        _put(ADK, tl.where(strict, d11, 0.), r1, m1, c_1, mc, H * BT)
        _put(ADK, d20, r2, m2, c_0, mc, H * BT)
        _put(ADK, d21, r2, m2, c_1, mc, H * BT)
        _put(ADK, tl.where(strict, d22, 0.), r2, m2, c_2, mc, H * BT)
        _put(ADK, d30, r3, m3, c_0, mc, H * BT)
        _put(ADK, d31, r3, m3, c_1, mc, H * BT)
        _put(ADK, d32, r3, m3, c_2, mc, H * BT)
        _put(ADK, tl.where(strict, d33, 0.), r3, m3, c_3, mc, H * BT)

    # ---- pass 3: Ai = (I + A_kk)^{-1}, blockwise
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

    # ---- pass 4: W, kg, qg, (dg, d), chunk decay
    W += i_h * K
    KG += i_h * K
    QG += i_h * K
    DG += i_h * K
    DPR += i_h * K
    for i_k in range(NK):
        cols = i_k * BKS + tl.arange(0, BKS)
        m_c = cols < K
        carry = tl.zeros([BKS], dtype=DT)
        bq0, bk0, ba0, bd0 = _recon(q, k, b, z, d_in, r0, m0, cols, m_c, i_h, rq0, rk0, c0, l0, K, H, ARM, DT)
        G0, carry = _gcum(g, r0, m0, cols, m_c, K, carry, H, DT)
        bq1, bk1, ba1, bd1 = _recon(q, k, b, z, d_in, r1, m1, cols, m_c, i_h, rq1, rk1, c1, l1, K, H, ARM, DT)
        G1, carry = _gcum(g, r1, m1, cols, m_c, K, carry, H, DT)
        bq2, bk2, ba2, bd2 = _recon(q, k, b, z, d_in, r2, m2, cols, m_c, i_h, rq2, rk2, c2, l2, K, H, ARM, DT)
        G2, carry = _gcum(g, r2, m2, cols, m_c, K, carry, H, DT)
        bq3, bk3, ba3, bd3 = _recon(q, k, b, z, d_in, r3, m3, cols, m_c, i_h, rq3, rk3, c3, l3, K, H, ARM, DT)
        G3, carry = _gcum(g, r3, m3, cols, m_c, K, carry, H, DT)
        ex0, ex1, ex2, ex3 = tl.exp(G0), tl.exp(G1), tl.exp(G2), tl.exp(G3)
        ae0, ae1, ae2, ae3 = ba0 * ex0, ba1 * ex1, ba2 * ex2, ba3 * ex3
        w0 = tl.dot(i00, ae0, input_precision=PREC)
        w1 = tl.dot(i10, ae0, input_precision=PREC) + tl.dot(i11, ae1, input_precision=PREC)
        w2 = (tl.dot(i20, ae0, input_precision=PREC) + tl.dot(i21, ae1, input_precision=PREC)
              + tl.dot(i22, ae2, input_precision=PREC))
        w3 = (tl.dot(i30, ae0, input_precision=PREC) + tl.dot(i31, ae1, input_precision=PREC)
              + tl.dot(i32, ae2, input_precision=PREC) + tl.dot(i33, ae3, input_precision=PREC))
        _put(W, w0, r0, m0, cols, m_c, H * K)
        _put(W, w1, r1, m1, cols, m_c, H * K)
        _put(W, w2, r2, m2, cols, m_c, H * K)
        _put(W, w3, r3, m3, cols, m_c, H * K)
        _put(KG, bk0 * tl.exp(carry[None, :] - G0), r0, m0, cols, m_c, H * K)
        _put(KG, bk1 * tl.exp(carry[None, :] - G1), r1, m1, cols, m_c, H * K)
        _put(KG, bk2 * tl.exp(carry[None, :] - G2), r2, m2, cols, m_c, H * K)
        _put(KG, bk3 * tl.exp(carry[None, :] - G3), r3, m3, cols, m_c, H * K)
        _put(QG, bq0 * ex0 * scale, r0, m0, cols, m_c, H * K)
        _put(QG, bq1 * ex1 * scale, r1, m1, cols, m_c, H * K)
        _put(QG, bq2 * ex2 * scale, r2, m2, cols, m_c, H * K)
        _put(QG, bq3 * ex3 * scale, r3, m3, cols, m_c, H * K)
        tl.store(GL + (i_g * H + i_h) * K + cols, tl.exp(carry).to(GL.dtype.element_ty), mask=m_c)
        if PROBES:
            _put(DG, bd0 * ex0, r0, m0, cols, m_c, H * K)
            _put(DG, bd1 * ex1, r1, m1, cols, m_c, H * K)
            _put(DG, bd2 * ex2, r2, m2, cols, m_c, H * K)
            _put(DG, bd3 * ex3, r3, m3, cols, m_c, H * K)
            _put(DPR, bd0, r0, m0, cols, m_c, H * K)
            _put(DPR, bd1, r1, m1, cols, m_c, H * K)
            _put(DPR, bd2, r2, m2, cols, m_c, H * K)
            _put(DPR, bd3, r3, m3, cols, m_c, H * K)

    # ---- pass 5: U = Ai (w * v)
    v += i_h * V
    w += i_h * V
    U += i_h * V
    for i_v in range(NV):
        cols = i_v * BVS + tl.arange(0, BVS)
        m_c = cols < V
        x0 = _tile(v, r0, m0, cols, m_c, H * V, DT) * _tile(w, r0, m0, cols, m_c, H * V, DT)
        x1 = _tile(v, r1, m1, cols, m_c, H * V, DT) * _tile(w, r1, m1, cols, m_c, H * V, DT)
        x2 = _tile(v, r2, m2, cols, m_c, H * V, DT) * _tile(w, r2, m2, cols, m_c, H * V, DT)
        x3 = _tile(v, r3, m3, cols, m_c, H * V, DT) * _tile(w, r3, m3, cols, m_c, H * V, DT)
        u0 = tl.dot(i00, x0, input_precision=PREC)
        u1 = tl.dot(i10, x0, input_precision=PREC) + tl.dot(i11, x1, input_precision=PREC)
        u2 = (tl.dot(i20, x0, input_precision=PREC) + tl.dot(i21, x1, input_precision=PREC)
              + tl.dot(i22, x2, input_precision=PREC))
        u3 = (tl.dot(i30, x0, input_precision=PREC) + tl.dot(i31, x1, input_precision=PREC)
              + tl.dot(i32, x2, input_precision=PREC) + tl.dot(i33, x3, input_precision=PREC))
        _put(U, u0, r0, m0, cols, m_c, H * V)
        _put(U, u1, r1, m1, cols, m_c, H * V)
        _put(U, u2, r2, m2, cols, m_c, H * V)
        _put(U, u3, r3, m3, cols, m_c, H * V)
