r"""Inter-chunk kernel of ``qed_chunk``: the state recurrence fused with the output.

One program per (sequence, head, block of ``BV`` value channels) walks the chunks in order with
the state block ``S`` (``K x BV``, float32 or float64) in registers::

    R   = U - W S                         residuals of the chunk's tokens
    o   = qg S + A_qk R                   (qg = scale q exp(G), A_qk causal incl. diagonal)
    Sd  = dg S + A_dk R                   probes only (dg = d exp(G), A_dk strictly causal)
    S  <- Diag(exp(G_last)) S + kg^T R    (kg = k exp(G_last - G))

The chunk-start states are written to ``HS`` (``[NC, H, K, V]``) only with ``STORE_STATES``
(the backward's recomputation, ``chunk_bwd.py``); the forward never writes them.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import chunk_rows, scan_program, scan_ranges, shifted


@triton.jit
def _chunk_step(S, i_t, bos, eos, c0, i_h, o_t, o_k, o_v, m_k, m_v, causal, strict,
                W, U, KG, QG, DG, AQK, ADK, GL, O, SD, HS, H: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BT: tl.constexpr, PROBES: tl.constexpr, STORE_STATES: tl.constexpr,
                DT: tl.constexpr, PREC: tl.constexpr):
    """One chunk: residuals, output (and Sd), state update; returns the next state."""
    if STORE_STATES:
        tl.store(HS + ((c0 + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                 S.to(HS.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
    rows, m_t, m_tk, m_tv = chunk_rows(i_t, bos, eos, o_t, m_k, m_v, BT)
    b_w = tl.load(W + rows[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.)
    b_qg = tl.load(QG + rows[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.)
    b_kg = tl.load(KG + rows[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.)
    b_u = tl.load(U + rows[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.).to(DT)
    b_a = tl.load(AQK + rows[:, None] * (H * BT) + o_t[None, :], mask=m_t[:, None] & causal, other=0.)
    b_gl = tl.load(GL + ((c0 + i_t) * H + i_h) * K + o_k, mask=m_k, other=0.).to(DT)

    b_s = S.to(b_w.dtype)
    b_r = b_u - tl.dot(b_w, b_s, input_precision=PREC)
    b_rc = b_r.to(b_w.dtype)
    b_o = tl.dot(b_qg, b_s, input_precision=PREC) + tl.dot(b_a, b_rc, input_precision=PREC)
    tl.store(O + rows[:, None] * (H * V) + o_v[None, :], b_o.to(O.dtype.element_ty), mask=m_tv)
    if PROBES:
        b_dg = tl.load(DG + rows[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.)
        b_ad = tl.load(ADK + rows[:, None] * (H * BT) + o_t[None, :], mask=m_t[:, None] & strict, other=0.)
        b_sd = tl.dot(b_dg, b_s, input_precision=PREC) + tl.dot(b_ad, b_rc, input_precision=PREC)
        tl.store(SD + rows[:, None] * (H * V) + o_v[None, :], b_sd.to(SD.dtype.element_ty), mask=m_tv)
    S = S * b_gl[:, None] + tl.dot(tl.trans(b_kg), b_rc, input_precision=PREC)
    return S


@triton.jit(do_not_specialize=['T'])
def qed_scan_kernel(
    W, U, KG, QG, DG, AQK, ADK, GL, H0, O, SD, HT, HS,
    cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, PROBES: tl.constexpr,
    STORE_STATES: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, WHILE_LOOP: tl.constexpr,
):
    i_v, i_nh, i_h, bos, eos, NT, c0 = scan_program(cu_seqlens, chunk_offsets, T, H, BT, IS_VARLEN)
    o_t, o_k, o_v, m_k, m_v = scan_ranges(i_v, K, V, BT, BK, BV)
    causal = o_t[:, None] >= o_t[None, :]
    strict = o_t[:, None] > o_t[None, :]

    S = tl.zeros([BK, BV], dtype=DT)
    if USE_H0:
        p_h = H0 + i_nh * K * V + o_k[:, None] * V + o_v[None, :]
        S += tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.).to(DT)

    W, KG, QG, DG = shifted((W, KG, QG, DG), i_h * K)
    U, O, SD = shifted((U, O, SD), i_h * V)
    AQK, ADK = shifted((AQK, ADK), i_h * BT)
    if WHILE_LOOP:  # the interpreter (numpy >= 2.4) cannot take a tensor as range() bound
        i_t = 0
        while i_t < NT:
            S = _chunk_step(S, i_t, bos, eos, c0, i_h, o_t, o_k, o_v, m_k, m_v, causal, strict,
                            W, U, KG, QG, DG, AQK, ADK, GL, O, SD, HS, H, K, V, BT, PROBES, STORE_STATES,
                            DT, PREC)
            i_t += 1
    else:
        for i_t in range(NT):
            S = _chunk_step(S, i_t, bos, eos, c0, i_h, o_t, o_k, o_v, m_k, m_v, causal, strict,
                            W, U, KG, QG, DG, AQK, ADK, GL, O, SD, HS, H, K, V, BT, PROBES, STORE_STATES,
                            DT, PREC)

    if STORE_HT:
        p_h = HT + i_nh * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_h, S.to(HT.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
