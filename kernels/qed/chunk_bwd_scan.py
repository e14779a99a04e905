r"""Reverse inter-chunk kernel of the ``qed_chunk`` backward: the state gradient, chunk by chunk.

Per chunk (notation of ``chunk.py``: ``S0`` the chunk-start state, ``R = U - W S0``,
``O = qg S0 + A_qk R``, ``S1 = Diag(gamma) S0 + kg^T R`` with ``gamma = exp(G_last)``), given
``dO`` and ``dS1`` (the gradient reaching the chunk's end state)::

    R    = U - W S0                                            -> RS (residuals)
    dR   = A_qk^T dO + kg dS1                                  -> DU (the gradient of U)
    dS1                                                        -> DH (per chunk)
    dS0  = qg^T dO - W^T dR + Diag(gamma) dS1                  (carried to the previous chunk)

One program per (sequence, head, block of ``BV`` value channels) walks the chunks backwards
with ``dS`` (``K x BV``) in registers, starting from the final-state gradient (or zero) and
ending with the initial-state gradient. ``S0`` comes from the chunk-start states ``HS``
(``[NC, H, K, V]``) that the forward scan stored; ``DH`` has the same layout. What sums over
the value axis (``dO S0^T``, ``dR S0^T``, ``R dS1^T``, ...) is left to ``chunk_bwd_intra``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import chunk_rows, scan_program, scan_ranges, state_block


@triton.jit
def _chunk_back(dS, i_t, bos, eos, c0, i_h, o_t, o_k, o_v, m_k, m_v, causal,
                W, U, KG, QG, AQK, GL, HS, DO, DU, RS, DH,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                DT: tl.constexpr, PREC: tl.constexpr):
    """One chunk backwards: writes R, dR and dS1; returns the chunk-start state gradient."""
    rows, m_t, m_tk, m_tv = chunk_rows(i_t, bos, eos, o_t, m_k, m_v, BT)
    p_tk = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
    p_tv = rows[:, None] * (H * V) + i_h * V + o_v[None, :]
    i_g = (c0 + i_t) * H + i_h
    p_h, m_h = state_block(i_g, o_k, o_v, m_k, m_v, K, V)
    b_w = tl.load(W + p_tk, mask=m_tk, other=0.).to(DT)
    b_qg = tl.load(QG + p_tk, mask=m_tk, other=0.).to(DT)
    b_kg = tl.load(KG + p_tk, mask=m_tk, other=0.).to(DT)
    b_u = tl.load(U + p_tv, mask=m_tv, other=0.).to(DT)
    b_do = tl.load(DO + p_tv, mask=m_tv, other=0.).to(DT)
    b_a = tl.load(AQK + rows[:, None] * (H * BT) + i_h * BT + o_t[None, :],
                  mask=m_t[:, None] & causal, other=0.).to(DT)
    b_gl = tl.load(GL + i_g * K + o_k, mask=m_k, other=0.).to(DT)
    b_s = tl.load(HS + p_h, mask=m_h, other=0.).to(DT)

    tl.store(DH + p_h, dS.to(DH.dtype.element_ty), mask=m_h)
    tl.store(RS + p_tv, (b_u - tl.dot(b_w, b_s, input_precision=PREC)).to(RS.dtype.element_ty), mask=m_tv)
    b_dr = tl.dot(tl.trans(b_a), b_do, input_precision=PREC) + tl.dot(b_kg, dS, input_precision=PREC)
    tl.store(DU + p_tv, b_dr.to(DU.dtype.element_ty), mask=m_tv)
    return (tl.dot(tl.trans(b_qg), b_do, input_precision=PREC)
            - tl.dot(tl.trans(b_w), b_dr, input_precision=PREC) + b_gl[:, None] * dS)


@triton.heuristics({
    "USE_DHT": lambda args: args["DHT"] is not None,
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
})
@triton.jit(do_not_specialize=['T'])
def qed_dstate_kernel(
    W, U, KG, QG, AQK, GL, HS, DO, DHT, DU, RS, DH, DH0,
    cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
):
    i_v, i_nh, i_h, bos, eos, NT, c0 = scan_program(cu_seqlens, chunk_offsets, T, H, BT, IS_VARLEN)
    o_t, o_k, o_v, m_k, m_v = scan_ranges(i_v, K, V, BT, BK, BV)
    causal = o_t[:, None] >= o_t[None, :]
    p_h, m_h = state_block(i_nh, o_k, o_v, m_k, m_v, K, V)

    dS = tl.zeros([BK, BV], dtype=DT)
    if USE_DHT:
        dS += tl.load(DHT + p_h, mask=m_h, other=0.).to(DT)
    if WHILE_LOOP:  # the interpreter (numpy >= 2.4) cannot take a tensor as range() bound
        i_t = NT - 1
        while i_t >= 0:
            dS = _chunk_back(dS, i_t, bos, eos, c0, i_h, o_t, o_k, o_v, m_k, m_v, causal,
                             W, U, KG, QG, AQK, GL, HS, DO, DU, RS, DH, H, K, V, BT, DT, PREC)
            i_t -= 1
    else:
        for i_r in range(NT):
            dS = _chunk_back(dS, NT - 1 - i_r, bos, eos, c0, i_h, o_t, o_k, o_v, m_k, m_v, causal,
                             W, U, KG, QG, AQK, GL, HS, DO, DU, RS, DH, H, K, V, BT, DT, PREC)
    tl.store(DH0 + p_h, dS.to(DH0.dtype.element_ty), mask=m_h)
