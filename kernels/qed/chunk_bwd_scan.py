r"""Reverse inter-chunk kernel of the ``qed_chunk`` backward: the state gradient, chunk by chunk
(as fla's ``chunk_gated_delta_rule_bwd_dhu``).

Per chunk (notation of ``chunk.py``: ``S0`` the chunk-start state, ``R = U - W S0``,
``O = qg S0 + A_qk R``, ``S1 = Diag(gamma) S0 + kg^T R`` with ``gamma = exp(G_last)``), given
``dO`` and ``dS1`` (the gradient reaching the chunk's end state)::

    dS1                                                        -> dh (per chunk)
    dR   = A_qk^T dO + kg dS1                                  -> dr (the gradient of R and of U)
    dS0  = qg^T dO - W^T dR + Diag(gamma) dS1                  (carried to the previous chunk)

One program per (block of ``BV`` value channels, sequence, value head) walks the chunks
backwards with only ``dS`` (``K x BV``, state dtype) carried in registers, from the final-state
gradient (or zero) to the initial-state gradient. It needs neither the states nor the residuals
(the recomputed forward scan wrote those): what sums over the value axis (``dO S0^T``,
``dR S0^T``, ``R dS1^T``, ...) is left to ``chunk_bwd_intra``. Products take their operands in
the dtype of the intermediate buffers (bf16 for bf16 inputs, as fla) with ``dS`` cast to it,
and accumulate in the state dtype.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import BT, ChunkLayout, scan_program, state_block

STATE_BKP = 64
"""Key rows per piece of the carried state gradient (fla's ``blockdim64``): the ``[K, BV]``
block is carried as ``cdiv(K, 64)`` separate ``[64, BV]`` tiles, and each chunk's ``kg, qg, W``
are read in the same ``[BT, 64]`` pieces, so no tile spans all of K."""
STATE_BV = 32
STATE_WARPS = 4
"""Value block and warps of the reverse scan. Four warps, not eight: with eight, Triton 3.6's sm_90
build gives wrong state gradients at bf16 (CHANGELOG.md, "Measurement history")."""


@triton.jit
def _load_pieces(ptr, i_nh, o_v, m_v, dS, K: tl.constexpr, V: tl.constexpr, BKP: tl.constexpr):
    """The pieces ``dS`` plus the ``[K, BV]`` block of state ``i_nh`` at ``ptr``."""
    out = ()
    for i in tl.static_range(len(dS)):
        o_k = i * BKP + tl.arange(0, BKP)
        p_h, m_h = state_block(i_nh, o_k, o_v, o_k < K, m_v, K, V)
        out = out + (dS[i] + tl.load(ptr + p_h, mask=m_h, other=0.).to(dS[i].dtype),)
    return out


@triton.jit
def _store_pieces(ptr, i_nh, o_v, m_v, dS, K: tl.constexpr, V: tl.constexpr, BKP: tl.constexpr):
    """Store the pieces ``dS`` as the ``[K, BV]`` block of state ``i_nh`` at ``ptr``."""
    for i in tl.static_range(len(dS)):
        o_k = i * BKP + tl.arange(0, BKP)
        p_h, m_h = state_block(i_nh, o_k, o_v, o_k < K, m_v, K, V)
        tl.store(ptr + p_h, dS[i].to(ptr.dtype.element_ty), mask=m_h)


@triton.jit
def _chunk_back(dS, i_t, n_t, c0, i_hv, o_t, o_v, m_v, w, kg, qg, aqk, gl, do, dh, dr,
                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKP: tl.constexpr,
                PREC: tl.constexpr):
    """One chunk backwards: stores ``dS1`` and ``dR``; returns the chunk-start state gradient.
    ``dS`` is a tuple of ``[BKP, BV]`` pieces (key rows ``i * BKP ..``). Per-token pointers are
    already moved to the sequence's first row and value head ``i_hv`` (``n_t`` rows); tile
    offsets are int32 from the chunk's first row."""
    i_g = (c0 + i_t) * HV + i_hv
    r0 = i_t * BT
    m_t = (r0 + o_t) < n_t
    m_tv = m_t[:, None] & m_v[None, :]
    p_tv = r0 * (HV * V) + o_t[:, None] * (HV * V) + o_v[None, :]
    b_do = tl.load(do + p_tv, mask=m_tv, other=0.)
    b_a = tl.load(aqk + r0 * (HV * BT) + o_t[:, None] * (HV * BT) + o_t[None, :],
                  mask=m_t[:, None] & (o_t[:, None] >= o_t[None, :]), other=0.)
    OP = b_a.dtype
    b_do = b_do.to(OP)
    b_dr = tl.dot(tl.trans(b_a), b_do, input_precision=PREC)
    for i in tl.static_range(len(dS)):
        o_k = i * BKP + tl.arange(0, BKP)
        m_k = o_k < K
        p_h, m_h = state_block(i_g, o_k, o_v, m_k, m_v, K, V)
        tl.store(dh + p_h, dS[i].to(dh.dtype.element_ty), mask=m_h)  # dS1, piece by piece with its kg
        b_kg = tl.load(kg + r0 * (HV * K) + o_t[:, None] * (HV * K) + o_k[None, :],
                       mask=m_t[:, None] & m_k[None, :], other=0.)
        b_dr += tl.dot(b_kg, dS[i].to(OP), input_precision=PREC)
    tl.store(dr + p_tv, b_dr.to(dr.dtype.element_ty), mask=m_tv)
    b_dr = b_dr.to(OP)
    out = ()
    for i in tl.static_range(len(dS)):
        o_k = i * BKP + tl.arange(0, BKP)
        m_k = o_k < K
        p_tk = r0 * (HV * K) + o_t[:, None] * (HV * K) + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        b_qg = tl.load(qg + p_tk, mask=m_tk, other=0.)
        b_w = tl.load(w + p_tk, mask=m_tk, other=0.)
        b_gl = tl.load(gl + i_g * K + o_k, mask=m_k, other=0.).to(dS[i].dtype)
        out = out + (b_gl[:, None] * dS[i] + tl.dot(tl.trans(b_qg), b_do, input_precision=PREC)
                     - tl.dot(tl.trans(b_w), b_dr, input_precision=PREC),)
    return out


@triton.heuristics({
    "USE_DHT": lambda args: args["dht"] is not None,
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
})
@triton.jit(do_not_specialize=["T"])
def qed_dstate_kernel(
    w, kg, qg, aqk, gl, do, dht, dh, dr, dh0,
    cu_seqlens, chunk_offsets, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BKP: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, WHILE_LOOP: tl.constexpr,
    USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_v, i_nh, i_hv, bos, eos, NT, c0 = scan_program(cu_seqlens, chunk_offsets, T, HV, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    dS = ()
    for i in tl.static_range((K + BKP - 1) // BKP):
        dS = dS + (tl.zeros([BKP, BV], dtype=DT),)
    if USE_DHT:
        dS = _load_pieces(dht, i_nh, o_v, m_v, dS, K, V, BKP)
    seq = bos * HV + i_hv  # the sequence's first row, this value head
    w, kg, qg = w + seq * K, kg + seq * K, qg + seq * K
    aqk, do, dr = aqk + seq * BT, do + seq * V, dr + seq * V
    n_t = eos - bos
    if WHILE_LOOP:  # the interpreter (numpy >= 2.4) cannot take a tensor as range() bound
        i_t = NT - 1
        while i_t >= 0:
            dS = _chunk_back(dS, i_t, n_t, c0, i_hv, o_t, o_v, m_v, w, kg, qg, aqk, gl, do, dh, dr,
                             HV, K, V, BT, BKP, PREC)
            i_t -= 1
    else:
        for i_r in range(NT):
            dS = _chunk_back(dS, NT - 1 - i_r, n_t, c0, i_hv, o_t, o_v, m_v, w, kg, qg, aqk, gl, do, dh, dr,
                             HV, K, V, BT, BKP, PREC)
    _store_pieces(dh0, i_nh, o_v, m_v, dS, K, V, BKP)


def chunk_bwd_state(lay: ChunkLayout, *, w, kg, qg, aqk, gl, do, dht, dh, dr, dh0, T: int, N: int) -> None:
    """Launch ``qed_dstate_kernel`` (grid: value blocks x sequences x value heads).

    Reads the recomputed ``w, kg, qg`` ``[B, T, HV, K]``, ``aqk`` ``[B, T, HV, BT]``, ``gl``
    ``[NC, HV, K]``, the output gradient ``do`` ``[B, T, HV, V]`` and the final-state gradient
    ``dht`` ``[N, HV, K, V]`` (or ``None``); writes the chunk-end state gradients ``dh``
    ``[NC, HV, K, V]``, ``dr`` ``[B, T, HV, V]`` (the gradient of the residuals) and the
    initial-state gradient ``dh0`` ``[N, HV, K, V]``.
    """
    _, _, HV, K = w.shape
    V = do.shape[-1]
    BV = min(STATE_BV, triton.next_power_of_2(V))
    qed_dstate_kernel[(triton.cdiv(V, BV), N * HV)](
        w=w, kg=kg, qg=qg, aqk=aqk, gl=gl, do=do, dht=dht, dh=dh, dr=dr, dh0=dh0,
        cu_seqlens=lay.cu_seqlens, chunk_offsets=lay.chunk_offsets, T=T,
        HV=HV, K=K, V=V, BT=BT, BKP=min(STATE_BKP, triton.next_power_of_2(K)), BV=BV, DT=lay.DT, PREC=lay.prec,
        WHILE_LOOP=lay.interpreting, num_warps=STATE_WARPS, num_stages=1,
    )
