r"""Intra-chunk kernel of the ``qed_chunk`` backward: per-token gradients from the chunk's pieces.

Per chunk (notation of ``chunk.py``; ``qs = scale q_hat``, ``Tm = (I + A_kk)^{-1}``,
``U = Tm (w v)``, ``W = Tm (a e^G)``, ``qg = qs e^G``, ``kg = k e^{G_last - G}``,
``gamma = e^{G_last}``, ``S0`` / ``dS1`` the chunk's start state / end-state gradient), given
what ``chunk_bwd_scan`` produced (``R``, ``dU = dR``, ``dS1``)::

    dqg = dO S0^T,  dW = -dR S0^T,  dkg = R dS1^T,  dgamma = sum_v S0 * dS1
    dA_qk   = dO R^T                                          (j <= t)
    d(wv)   = Tm^T dU                     d(a e^G) = Tm^T dW
    dA_kk   = -(d(wv) U^T + d(a e^G) W^T)                 (strictly lower part)
    A_xk[t,j] = sum_c x_{t,c} k_{j,c} e^{G_{t,c} - G_{j,c}}  for (x, A) = (qs, A_qk), (a, A_kk):
        dx_t += sum_j dA[t,j] k_j e^{G_t - G_j}
        dk_j += sum_t dA[t,j] x_t e^{G_t - G_j}
        dG   += x * dx(this term) - k * dk(this term)
    elementwise terms: dqs += dqg e^G, da += d(a e^G) e^G, dk += dkg e^{G_last - G},
        dG += dqg qg + d(a e^G) a e^G - dkg kg,  dG_last += sum_t dkg kg + dgamma gamma
    dg_t = sum_{s >= t} dG_s + dG_last                       (G is the cumsum of g)

Two kernels: ``qed_bwd_wy_kernel`` (one program per chunk and head: every product over the
value axis or over all keys: ``d(wv)``, ``dA_qk``, ``dqg, dkg, dgamma``, ``d(a e^G)``, ``dA_kk``,
through the scratch buffers ``DQG, DKG, DGL, DAQK, DG`` and ``AKK``), then
``qed_bwd_scores_kernel`` (one program per chunk, head and key slice: the rest is channel-local
once ``dA`` is known). The score terms go by ``BC = 16``-token blocks: off-diagonal
blocks as tensor-core products with a reference point inside the pair (both decay factors
<= 1), diagonal blocks with exact per-element decays ``e^{G_t - G_j} <= 1`` (``t >= j``); so any
``g <= 0`` is safe. ``dA_kk`` is written over the ``AKK`` scratch (it held ``Tm``); the score
terms go to ``DQ, DA, DK`` and ``d(a e^G)`` to ``DG`` first, read back in the final pass. Key
channels are handled in slices of ``BKS`` (every term above is channel-local once ``dA`` is
known). Outputs: ``dq_hat`` (= ``scale dqs``), ``dk_hat``, ``da``, ``dg``, ``d(wv)``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import store_tile, tile_row, load_tile, channel_slice, chunk_position, shifted


@triton.jit
def _score_terms(qs, kh, a, G, dAqk, dAkk, o_t, BT: tl.constexpr):
    """Exact gradients of the score blocks w.r.t. qs, a, k on one ``[BT, BKS]`` diagonal block.

    ``dAqk`` / ``dAkk`` are the block's ``[BT, BT]`` gradients (already masked); decays are formed
    per element, ``e^{G_t - G_j} <= 1`` for ``t >= j``.
    """
    dqp = qs * 0.
    dap = qs * 0.
    dkp = qs * 0.
    for j in range(BT):
        sel = o_t == j
        gj = tl.sum(tl.where(sel[:, None], G, 0.), 0)
        kj = tl.sum(tl.where(sel[:, None], kh, 0.), 0)
        e = tl.where(o_t[:, None] >= j, tl.exp(tl.minimum(G - gj[None, :], 0.)), 0.)
        cq = tl.sum(tl.where(sel[None, :], dAqk, 0.), 1)[:, None] * e
        ca = tl.sum(tl.where(sel[None, :], dAkk, 0.), 1)[:, None] * e
        dqp += cq * kj[None, :]
        dap += ca * kj[None, :]
        dkj = tl.sum(cq * qs + ca * a, 0)
        dkp = tl.where(sel[:, None], dkp + dkj[None, :], dkp)
    return dqp, dap, dkp


@triton.jit
def _block(X, g, g_f, rows, m_r, cols, m_c, o_t, J: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
           BC: tl.constexpr, DT: tl.constexpr):
    """Row block ``J`` (``BC`` tokens) of ``X`` and of the within-chunk cumsum ``G``."""
    prefix = tl.sum(tl.where(o_t[:, None] < J * BC, g_f, 0.), 0)
    G = tl.cumsum(load_tile(g, rows, m_r, cols, m_c, H * K, DT), 0) + prefix[None, :]
    return load_tile(X, rows, m_r, cols, m_c, H * K, DT), G


@triton.jit
def _dblock(D, rows, m_r, I: tl.constexpr, J: tl.constexpr, H: tl.constexpr, BT: tl.constexpr,
            BC: tl.constexpr, DT: tl.constexpr):
    """Block ``(I, J)`` (``BC x BC``) of a ``[BT, BT]``-per-chunk score gradient."""
    cols = J * BC + tl.arange(0, BC)
    return load_tile(D, rows, m_r, cols, cols < BT, H * BT, DT)


@triton.jit
def _block_terms(QH, KH, A, g, DAQK, DAKK, DQ, DA, DK, g_f, r0, eos, cols, m_c, o_t, scale,
                 I: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                 DT: tl.constexpr, PREC: tl.constexpr):
    """Score-term gradients of row block ``I``: ``dqs, da`` (from column blocks ``J <= I``) and
    ``dk`` (from row blocks ``I' >= I``), written to ``DQ, DA, DK``.

    Off-diagonal blocks are products with the reference point ``s`` = first row of the later
    block: ``e^{G_t - G_j} = e^{G_t - G_s} e^{G_s - G_j}``, both factors <= 1; diagonal blocks use
    exact per-element decays (:func:`_score_terms`).
    """
    o_c = tl.arange(0, BC)
    rI = r0 + I * BC + o_c
    mI = rI < eos
    kI, GI = _block(KH, g, g_f, rI, mI, cols, m_c, o_t, I, H, K, BC, DT)
    qI = load_tile(QH, rI, mI, cols, m_c, H * K, DT) * scale
    aI = load_tile(A, rI, mI, cols, m_c, H * K, DT)
    causal = o_c[:, None] >= o_c[None, :]
    dq, da, dk = _score_terms(qI, kI, aI, GI,
                              tl.where(causal, _dblock(DAQK, rI, mI, I, I, H, BT, BC, DT), 0.),
                              tl.where(o_c[:, None] > o_c[None, :], _dblock(DAKK, rI, mI, I, I, H, BT, BC, DT), 0.),
                              o_c, BC)
    sI = tile_row(GI, 0, BC)
    accq = dq * 0.
    acca = dq * 0.
    for J in tl.static_range(I):
        rJ = r0 + J * BC + o_c
        mJ = rJ < eos
        kJ, GJ = _block(KH, g, g_f, rJ, mJ, cols, m_c, o_t, J, H, K, BC, DT)
        ke = kJ * tl.exp(sI[None, :] - GJ)
        accq += tl.dot(_dblock(DAQK, rI, mI, I, J, H, BT, BC, DT), ke, input_precision=PREC)
        acca += tl.dot(_dblock(DAKK, rI, mI, I, J, H, BT, BC, DT), ke, input_precision=PREC)
    eI = tl.exp(GI - sI[None, :])
    dq += eI * accq
    da += eI * acca
    for I2 in tl.static_range(I + 1, BT // BC):
        r2 = r0 + I2 * BC + o_c
        m2 = r2 < eos
        a2, G2 = _block(A, g, g_f, r2, m2, cols, m_c, o_t, I2, H, K, BC, DT)
        q2 = load_tile(QH, r2, m2, cols, m_c, H * K, DT) * scale
        s2 = tile_row(G2, 0, BC)
        e2 = tl.exp(G2 - s2[None, :])
        acc = (tl.dot(tl.trans(_dblock(DAQK, r2, m2, I2, I, H, BT, BC, DT)), q2 * e2, input_precision=PREC)
               + tl.dot(tl.trans(_dblock(DAKK, r2, m2, I2, I, H, BT, BC, DT)), a2 * e2, input_precision=PREC))
        dk += tl.exp(s2[None, :] - GI) * acc
    store_tile(DQ, dq, rI, mI, cols, m_c, H * K)
    store_tile(DA, da, rI, mI, cols, m_c, H * K)
    store_tile(DK, dk, rI, mI, cols, m_c, H * K)


@triton.heuristics({"IS_VARLEN": lambda args: args["cu_seqlens"] is not None})
@triton.jit(do_not_specialize=['T'])
def qed_bwd_wy_kernel(
    AKK, W, U, HS, DO, DU, RS, DH, DQG, DKG, DGL, DAQK, DG, DWV,
    cu_seqlens, chunk_indices, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BKS: tl.constexpr, BVS: tl.constexpr, NK: tl.constexpr,
    NV: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk: ``d(wv)``, ``dA_qk``, ``dqg, dkg, dgamma``, ``d(a e^G)`` and ``dA_kk`` (over
    ``AKK``, which held ``Tm``): every term that sums over the value axis or over all keys."""
    i_h, i_t, i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)

    o_t = tl.arange(0, BT)
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    AKK, DAQK = shifted((AKK, DAQK), i_h * BT)
    Tm = tl.load(AKK + rows[:, None] * (H * BT) + o_t[None, :],
                 mask=m_t[:, None] & (o_t[None, :] <= o_t[:, None]), other=0.).to(DT)

    # ---- over value blocks: d(wv) = Tm^T dU (an output), dA_kk -= d(wv) U^T, dA_qk = dO R^T
    dAkk = tl.zeros([BT, BT], dtype=DT)
    dAqk = tl.zeros([BT, BT], dtype=DT)
    U, DO, DU, RS, DWV = shifted((U, DO, DU, RS, DWV), i_h * V)
    for i_v in range(NV):
        cols, m_c = channel_slice(i_v, BVS, V)
        dwv = tl.dot(tl.trans(Tm), load_tile(DU, rows, m_t, cols, m_c, H * V, DT), input_precision=PREC)
        store_tile(DWV, dwv, rows, m_t, cols, m_c, H * V)
        dAkk -= tl.dot(dwv, tl.trans(load_tile(U, rows, m_t, cols, m_c, H * V, DT)), input_precision=PREC)
        dAqk += tl.dot(load_tile(DO, rows, m_t, cols, m_c, H * V, DT),
                       tl.trans(load_tile(RS, rows, m_t, cols, m_c, H * V, DT)), input_precision=PREC)
    store_tile(DAQK, tl.where(o_t[:, None] >= o_t[None, :], dAqk, 0.), rows, m_t, o_t, o_t < BT, H * BT)

    # ---- over key slices: dqg, dkg, dgamma, dW (sums over value blocks with S0, dS1), then
    # d(a e^G) = Tm^T dW and dA_kk -= d(a e^G) W^T
    off = i_h * K
    p_s = (i_g * H + i_h) * K * V
    for i_k in range(NK):
        cols, m_c = channel_slice(i_k, BKS, K)
        dqg = tl.zeros([BT, BKS], dtype=DT)
        dkg = tl.zeros([BT, BKS], dtype=DT)
        dw = tl.zeros([BT, BKS], dtype=DT)
        dgam = tl.zeros([BKS], dtype=DT)
        for i_v in range(NV):
            cv, m_v = channel_slice(i_v, BVS, V)
            s0 = load_tile(HS + p_s, cols, m_c, cv, m_v, V, DT)
            ds1 = load_tile(DH + p_s, cols, m_c, cv, m_v, V, DT)
            dqg += tl.dot(load_tile(DO, rows, m_t, cv, m_v, H * V, DT), tl.trans(s0), input_precision=PREC)
            dw -= tl.dot(load_tile(DU, rows, m_t, cv, m_v, H * V, DT), tl.trans(s0), input_precision=PREC)
            dkg += tl.dot(load_tile(RS, rows, m_t, cv, m_v, H * V, DT), tl.trans(ds1), input_precision=PREC)
            dgam += tl.sum(s0 * ds1, 1)
        store_tile(DQG + off, dqg, rows, m_t, cols, m_c, H * K)
        store_tile(DKG + off, dkg, rows, m_t, cols, m_c, H * K)
        tl.store(DGL + (i_g * H + i_h) * K + cols, dgam.to(DGL.dtype.element_ty), mask=m_c)
        dag = tl.dot(tl.trans(Tm), dw, input_precision=PREC)
        store_tile(DG + off, dag, rows, m_t, cols, m_c, H * K)  # d(a e^G), read by qed_bwd_scores_kernel
        dAkk -= tl.dot(dag, tl.trans(load_tile(W + off, rows, m_t, cols, m_c, H * K, DT)), input_precision=PREC)
    dAkk = tl.where(o_t[:, None] > o_t[None, :], dAkk, 0.)
    tl.debug_barrier()
    store_tile(AKK, dAkk, rows, m_t, o_t, o_t < BT, H * BT)  # AKK now holds dA_kk


@triton.heuristics({"IS_VARLEN": lambda args: args["cu_seqlens"] is not None})
@triton.jit(do_not_specialize=['T'])
def qed_bwd_scores_kernel(
    QH, KH, A, g, DAKK, DQG, DKG, DGL, DAQK, DQ, DK, DA, DG,
    cu_seqlens, chunk_indices, T, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr,
    IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk and key slice ``i_k = program_id(2)``: the score terms per row block (to ``DQ,
    DA, DK``), then the elementwise terms and the reverse cumsum of ``dG`` over the chunk."""
    i_h, i_t, i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    i_k = tl.program_id(2)
    o_t = tl.arange(0, BT)
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    DAKK, DAQK = shifted((DAKK, DAQK), i_h * BT)
    off = i_h * K
    QH, KH, A, g, DQ, DA, DK, DG, DQG, DKG = shifted((QH, KH, A, g, DQ, DA, DK, DG, DQG, DKG), off)
    r0 = bos + i_t * BT
    cols, m_c = channel_slice(i_k, BKS, K)
    g_f = load_tile(g, rows, m_t, cols, m_c, H * K, DT)
    for I in tl.static_range(BT // BC):
        _block_terms(QH, KH, A, g, DAQK, DAKK, DQ, DA, DK, g_f, r0, eos, cols, m_c, o_t, scale,
                     I, H, K, BT, BC, DT, PREC)
    tl.debug_barrier()
    G = tl.cumsum(g_f, 0)
    gl = tl.sum(g_f, 0)
    qs = load_tile(QH, rows, m_t, cols, m_c, H * K, DT) * scale
    kh = load_tile(KH, rows, m_t, cols, m_c, H * K, DT)
    a = load_tile(A, rows, m_t, cols, m_c, H * K, DT)
    dqp = load_tile(DQ, rows, m_t, cols, m_c, H * K, DT)
    dap = load_tile(DA, rows, m_t, cols, m_c, H * K, DT)
    dkp = load_tile(DK, rows, m_t, cols, m_c, H * K, DT)
    eg = tl.where(m_t[:, None], tl.exp(G), 0.)
    ekl = tl.where(m_t[:, None], tl.exp(gl[None, :] - G), 0.)
    dqg = load_tile(DQG, rows, m_t, cols, m_c, H * K, DT)
    dkg = load_tile(DKG, rows, m_t, cols, m_c, H * K, DT)
    dag = load_tile(DG, rows, m_t, cols, m_c, H * K, DT)
    dgam = tl.load(DGL + (i_g * H + i_h) * K + cols, mask=m_c, other=0.).to(DT)
    kgd = dkg * kh * ekl
    dG = dqg * qs * eg + dag * a * eg - kgd + qs * dqp + a * dap - kh * dkp
    dgl = tl.sum(kgd, 0) + dgam * tl.exp(gl)
    tl.debug_barrier()
    store_tile(DQ, (dqg * eg + dqp) * scale, rows, m_t, cols, m_c, H * K)
    store_tile(DA, dag * eg + dap, rows, m_t, cols, m_c, H * K)
    store_tile(DK, dkg * ekl + dkp, rows, m_t, cols, m_c, H * K)
    store_tile(DG, tl.cumsum(dG, 0, reverse=True) + dgl[None, :], rows, m_t, cols, m_c, H * K)
