r"""Inter-chunk kernel of ``qed_chunk``: the state recurrence fused with the output.

One program per (sequence, value head, block of ``BV`` value channels) walks the chunks in order with
the state block ``S`` (``K x BV``, float32 or float64) in registers::

    R   = U - W S                         residuals of the chunk's tokens
    o   = qg S + A_qk R                   (qg = scale q exp(G), A_qk causal incl. diagonal)
    Sd  = dg S + A_dk R                   probes only (dg = d exp(G), A_dk strictly causal)
    S  <- Diag(exp(G_last)) S + kg^T R    (kg = k exp(G_last - G))

The chunk-start states are written to ``hs`` (``[NC, HV, K, V]``) only when it is given (the
backward's recomputation, ``chunk_bwd.py``); the forward never writes them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_common import BT, ChunkLayout, chunk_rows, scan_program, scan_ranges, shifted


@triton.jit
def _chunk_step(S, i_t, bos, eos, c0, i_hv, o_t, o_k, o_v, m_k, m_v, causal, strict,
                w, u, kg, qg, dg, aqk, adk, gl, o, sd, hs, HV: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BT: tl.constexpr, PROBES: tl.constexpr, STORE_STATES: tl.constexpr,
                DT: tl.constexpr, PREC: tl.constexpr):
    """One chunk: residuals, output (and Sd), state update; returns the next state. Per-token
    pointers are already moved to value head ``i_hv``."""
    if STORE_STATES:
        tl.store(hs + ((c0 + i_t) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                 S.to(hs.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
    rows, m_t, m_tk, m_tv = chunk_rows(i_t, bos, eos, o_t, m_k, m_v, BT)
    b_w = tl.load(w + rows[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.)
    b_qg = tl.load(qg + rows[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.)
    b_kg = tl.load(kg + rows[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.)
    b_u = tl.load(u + rows[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.).to(DT)
    b_a = tl.load(aqk + rows[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None] & causal, other=0.)
    b_gl = tl.load(gl + ((c0 + i_t) * HV + i_hv) * K + o_k, mask=m_k, other=0.).to(DT)

    b_s = S.to(b_w.dtype)
    b_r = b_u - tl.dot(b_w, b_s, input_precision=PREC)
    b_rc = b_r.to(b_w.dtype)
    b_o = tl.dot(b_qg, b_s, input_precision=PREC) + tl.dot(b_a, b_rc, input_precision=PREC)
    tl.store(o + rows[:, None] * (HV * V) + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
    if PROBES:
        b_dg = tl.load(dg + rows[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.)
        b_ad = tl.load(adk + rows[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None] & strict, other=0.)
        b_sd = tl.dot(b_dg, b_s, input_precision=PREC) + tl.dot(b_ad, b_rc, input_precision=PREC)
        tl.store(sd + rows[:, None] * (HV * V) + o_v[None, :], b_sd.to(sd.dtype.element_ty), mask=m_tv)
    S = S * b_gl[:, None] + tl.dot(tl.trans(b_kg), b_rc, input_precision=PREC)
    return S


@triton.heuristics({
    "USE_H0": lambda args: args["h0"] is not None,
    "STORE_HT": lambda args: args["ht"] is not None,
    "STORE_STATES": lambda args: args["hs"] is not None,
    "PROBES": lambda args: args["sd"] is not None,
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
})
@triton.jit(do_not_specialize=["T"])
def qed_scan_kernel(
    w, u, kg, qg, dg, aqk, adk, gl, h0, o, sd, ht, hs,
    cu_seqlens, chunk_offsets, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, WHILE_LOOP: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_STATES: tl.constexpr, PROBES: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    i_v, i_nh, i_hv, bos, eos, NT, c0 = scan_program(cu_seqlens, chunk_offsets, T, HV, BT, IS_VARLEN)
    o_t, o_k, o_v, m_k, m_v = scan_ranges(i_v, K, V, BT, BK, BV)
    causal = o_t[:, None] >= o_t[None, :]
    strict = o_t[:, None] > o_t[None, :]

    S = tl.zeros([BK, BV], dtype=DT)
    if USE_H0:
        p_h = h0 + i_nh * K * V + o_k[:, None] * V + o_v[None, :]
        S += tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.).to(DT)

    w, kg, qg = shifted((w, kg, qg), i_hv * K)
    u, o = shifted((u, o), i_hv * V)
    aqk += i_hv * BT
    if PROBES:
        dg += i_hv * K
        sd += i_hv * V
        adk += i_hv * BT
    if WHILE_LOOP:  # the interpreter (numpy >= 2.4) cannot take a tensor as range() bound
        i_t = 0
        while i_t < NT:
            S = _chunk_step(S, i_t, bos, eos, c0, i_hv, o_t, o_k, o_v, m_k, m_v, causal, strict,
                            w, u, kg, qg, dg, aqk, adk, gl, o, sd, hs, HV, K, V, BT, PROBES, STORE_STATES,
                            DT, PREC)
            i_t += 1
    else:
        for i_t in range(NT):
            S = _chunk_step(S, i_t, bos, eos, c0, i_hv, o_t, o_k, o_v, m_k, m_v, causal, strict,
                            w, u, kg, qg, dg, aqk, adk, gl, o, sd, hs, HV, K, V, BT, PROBES, STORE_STATES,
                            DT, PREC)

    if STORE_HT:
        p_h = ht + i_nh * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_h, S.to(ht.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])


def scan_config(K: int, V: int, inter_dtype: torch.dtype) -> tuple[int, int, int]:
    """``(BV, num_warps, num_stages)`` of the scan, by rule from ``K``, ``V`` and the dtype of the
    intra buffers: bf16 tiles with ``K <= 128`` are pipelined two deep; float32 / float64
    ``[64, K]`` tiles do not fit twice in shared memory (K=128 asks 295 KB / 426 KB of the 227 KB
    with two stages), nor do bf16 ones with K=256: one stage there."""
    BK = triton.next_power_of_2(K)
    BV = 64 if (BK <= 128 and inter_dtype != torch.float64) else 32
    stages = 2 if (inter_dtype == torch.bfloat16 and BK <= 128) else 1
    return min(BV, triton.next_power_of_2(V)), 4 if BK <= 128 else 8, stages


def chunk_scan_fwd(lay: ChunkLayout, *, w, u, kg, qg, aqk, gl, o, dg=None, adk=None, sd=None, h0=None, ht=None,
                   hs=None, T: int, N: int) -> None:
    """Launch ``qed_scan_kernel`` (grid: value blocks x sequences x value heads): writes ``o``
    ``[B, T, HV, V]`` and, when given, the probe ``sd`` (with ``dg, adk``), the final states
    ``ht`` and the chunk-start states ``hs`` ``[NC, HV, K, V]``; ``h0`` the initial states."""
    _, _, HV, K = w.shape
    V = u.shape[-1]
    BV, num_warps, num_stages = scan_config(K, V, w.dtype)
    qed_scan_kernel[(triton.cdiv(V, BV), N * HV)](
        w=w, u=u, kg=kg, qg=qg, dg=dg, aqk=aqk, adk=adk, gl=gl, h0=h0, o=o, sd=sd, ht=ht, hs=hs,
        cu_seqlens=lay.cu_seqlens, chunk_offsets=lay.chunk_offsets, T=T,
        HV=HV, K=K, V=V, BT=BT, BK=triton.next_power_of_2(K), BV=BV, DT=lay.DT, PREC=lay.prec,
        WHILE_LOOP=lay.interpreting, num_warps=num_warps, num_stages=num_stages,
    )
