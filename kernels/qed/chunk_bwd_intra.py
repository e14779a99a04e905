r"""Intra-chunk kernel of the ``qed_chunk`` backward: per-token gradients from the chunk's pieces.

Per chunk (notation of ``chunk.py``; ``qs = scale q_hat``, ``Tm = (I + A_kk)^{-1}``,
``U = Tm (w v)``, ``W = Tm (a e^G)``, ``qg = qs e^G``, ``kg = k e^{G_last - G}``,
``gamma = e^{G_last}``), given what ``chunk_bwd_scan`` produced (``dU``, and summed over value
blocks ``dqg, dW, dkg, dgamma, dA_qk``)::

    d(wv)   = Tm^T dU                     d(a e^G) = Tm^T dW
    dA_kk   = -(d(wv) U^T + d(a e^G) W^T)                 (strictly lower part)
    A_xk[t,j] = sum_c x_{t,c} k_{j,c} e^{G_{t,c} - G_{j,c}}  for (x, A) = (qs, A_qk), (a, A_kk):
        dx_t += sum_j dA[t,j] k_j e^{G_t - G_j}
        dk_j += sum_t dA[t,j] x_t e^{G_t - G_j}
        dG   += x * dx(this term) - k * dk(this term)
    elementwise terms: dqs += dqg e^G, da += d(a e^G) e^G, dk += dkg e^{G_last - G},
        dG += dqg qg + d(a e^G) a e^G - dkg kg,  dG_last += sum_t dkg kg + dgamma gamma
    dg_t = sum_{s >= t} dG_s + dG_last                       (G is the cumsum of g)

One program per chunk and head. The score terms loop over the chunk's 64 columns ``j`` with
exact per-element decays ``e^{G_t - G_j} <= 1`` (``t >= j``), so any ``g <= 0`` is safe; key
channels are handled in slices of ``BKS`` (every term above is channel-local once ``dA`` is
known). Outputs: ``dq_hat`` (= ``scale dqs``), ``dk_hat``, ``da``, ``dg``, ``d(wv)``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .chunk_intra import _put, _tile


@triton.jit
def _score_terms(qs, kh, a, G, dAqk, dAkk, o_t, BT: tl.constexpr):
    """Gradients of ``A_qk`` and ``A_kk`` w.r.t. qs, a, k on one ``[BT, BKS]`` slice."""
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


@triton.jit(do_not_specialize=['T'])
def qed_intra_bwd_kernel(
    QH, KH, A, g, AKK, W, U, DU, DQG, DW, DKG, DGL, DAQK,
    DQ, DK, DA, DG, DWV,
    cu_seqlens, chunk_indices, T, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BKS: tl.constexpr, BVS: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
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

    o_t = tl.arange(0, BT)
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    AKK += i_h * BT
    DAQK += i_h * BT
    Tm = tl.load(AKK + rows[:, None] * (H * BT) + o_t[None, :],
                 mask=m_t[:, None] & (o_t[None, :] <= o_t[:, None]), other=0.).to(DT)
    dAqk = tl.load(DAQK + rows[:, None] * (H * BT) + o_t[None, :],
                   mask=m_t[:, None] & (o_t[None, :] <= o_t[:, None]), other=0.).to(DT)

    # ---- dA_kk = -(d(wv) U^T + d(a e^G) W^T); d(wv) = Tm^T dU is an output
    dAkk = tl.zeros([BT, BT], dtype=DT)
    U += i_h * V
    DU += i_h * V
    DWV += i_h * V
    for i_v in range(NV):
        cols = i_v * BVS + tl.arange(0, BVS)
        m_c = cols < V
        dwv = tl.dot(tl.trans(Tm), _tile(DU, rows, m_t, cols, m_c, H * V, DT), input_precision=PREC)
        _put(DWV, dwv, rows, m_t, cols, m_c, H * V)
        dAkk -= tl.dot(dwv, tl.trans(_tile(U, rows, m_t, cols, m_c, H * V, DT)), input_precision=PREC)
    off = i_h * K
    for i_k in range(NK):
        cols = i_k * BKS + tl.arange(0, BKS)
        m_c = cols < K
        dag = tl.dot(tl.trans(Tm), _tile(DW + off, rows, m_t, cols, m_c, H * K, DT), input_precision=PREC)
        dAkk -= tl.dot(dag, tl.trans(_tile(W + off, rows, m_t, cols, m_c, H * K, DT)), input_precision=PREC)
    dAkk = tl.where(o_t[:, None] > o_t[None, :], dAkk, 0.)

    # ---- per key-channel slice: elementwise terms, score terms, reverse cumsum of dG
    for i_k in range(NK):
        cols = i_k * BKS + tl.arange(0, BKS)
        m_c = cols < K
        g_f = _tile(g + off, rows, m_t, cols, m_c, H * K, DT)
        G = tl.cumsum(g_f, 0)
        gl = tl.sum(g_f, 0)
        qs = _tile(QH + off, rows, m_t, cols, m_c, H * K, DT) * scale
        kh = _tile(KH + off, rows, m_t, cols, m_c, H * K, DT)
        a = _tile(A + off, rows, m_t, cols, m_c, H * K, DT)
        eg = tl.where(m_t[:, None], tl.exp(G), 0.)
        ekl = tl.where(m_t[:, None], tl.exp(gl[None, :] - G), 0.)
        dqg = _tile(DQG + off, rows, m_t, cols, m_c, H * K, DT)
        dkg = _tile(DKG + off, rows, m_t, cols, m_c, H * K, DT)
        dag = tl.dot(tl.trans(Tm), _tile(DW + off, rows, m_t, cols, m_c, H * K, DT), input_precision=PREC)
        dgam = tl.load(DGL + (i_g * H + i_h) * K + cols, mask=m_c, other=0.).to(DT)
        dqp, dap, dkp = _score_terms(qs, kh, a, G, dAqk, dAkk, o_t, BT)
        kgd = dkg * kh * ekl
        dG = dqg * qs * eg + dag * a * eg - kgd + qs * dqp + a * dap - kh * dkp
        dgl = tl.sum(kgd, 0) + dgam * tl.exp(gl)
        _put(DQ + off, (dqg * eg + dqp) * scale, rows, m_t, cols, m_c, H * K)
        _put(DA + off, dag * eg + dap, rows, m_t, cols, m_c, H * K)
        _put(DK + off, dkg * ekl + dkp, rows, m_t, cols, m_c, H * K)
        _put(DG + off, tl.cumsum(dG, 0, reverse=True) + dgl[None, :], rows, m_t, cols, m_c, H * K)
