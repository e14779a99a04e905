r"""Intra-chunk kernels of the ``qed_chunk`` backward: per-token gradients from the chunk's pieces.

Per chunk (notation of ``chunk.py``; ``qs = scale q_hat``, ``Tm = (I + A_kk)^{-1}``,
``U = Tm (w v)``, ``W = Tm (a e^G)``, ``qg = qs e^G``, ``kg = k e^{G_last - G}``,
``gamma = e^{G_last}``, ``S0`` / ``dS1`` the chunk's start state / end-state gradient), given
the residuals ``R`` of the recomputed forward scan and what ``chunk_bwd_scan`` produced
(``dR``, which is also ``dU``, and ``dS1``)::

    dqg = dO S0^T,  dW = -dR S0^T,  dkg = R dS1^T,  dgamma = sum_v S0 * dS1
    dA_qk   = dO R^T                                          (j <= t)
    d(wv)   = Tm^T dU                     d(a e^G) = Tm^T dW
    dA_kk   = -(d(wv) U^T + d(a e^G) W^T)                 (strictly lower part)
    A_xk[t,j] = sum_c x_{t,c} k_{j,c} e^{G_{t,c} - G_{j,c}}  for (x, A) = (qs, A_qk), (a, A_kk):
        dx_t += sum_j dA[t,j] k_j e^{G_t - G_j}
        dk_j += sum_t dA[t,j] x_t e^{G_t - G_j}
        dG   += x * dx(this term) - k * dk(this term)
    elementwise terms: dqs += dqg e^G, da += d(a e^G) e^G, dk += dkg e^{G_last - G},
        dG += dqg qg + d(a e^G) a e^G - dkg kg,  dG_last = sum_t dkg kg + dgamma gamma
    dg_t = sum_{s >= t} dG_s + dG_last                       (G is the cumsum of g)

Three kernels, behind two typed wrappers. ``qed_bwd_wy_kernel`` (:func:`chunk_bwd_wy`, one
program per chunk and value head): every product over the value axis or over all keys, into
:class:`WYGrads`. Then :func:`chunk_bwd_scores`, once ``dA`` is known the rest is channel-local:

* ``qed_bwd_scores_kernel``: one program per ``BC = 16``-token row block ``I`` of a chunk, value
  head and key slice of ``BKS`` channels (fla's ``chunk_gdn2_bwd_kernel_intra`` layout). It loads
  its block's ``G, qs, k_hat, a`` once (written by the backward's rerun of the prep, so nothing is
  rebuilt) and forms the block's score terms: ``dqs, da`` from the earlier column blocks and
  ``dk`` from the later row blocks as tensor-core products with one reference row per side (the
  block's first row for the earlier blocks, its last for the later ones, so both decay factors of
  every pair are <= 1), the diagonal block exactly (per row ``i``: row ``i`` of ``k_hat, qs, a,
  G`` and column / row ``i`` of ``dA_qk, dA_kk`` loaded, one tile of decays ``e^{-|G_t - G_i|}
  <= 1`` formed per element serving both the column and the row), so any ``g <= 0`` is safe;
  then the elementwise terms. It writes the block's ``dq_hat`` (= ``scale dqs``), ``dk_hat``,
  ``da``, its rows of ``dG`` and its rows' sum of ``dkg kg``.
* ``qed_bwd_dg_kernel``: one program per chunk, value head and key slice: ``dG_last`` (the row
  blocks' sums and ``dgamma gamma``) and ``dg``, the reverse cumsum of ``dG`` plus ``dG_last``.

Outputs: ``dq_hat``, ``dk_hat``, ``da``, ``dg``, and ``dv, dw`` from ``d(wv)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .chunk_common import (BC, BT, ChunkLayout, channel_slice, chunk_at, chunk_position, exp, load_tile, shifted,
                           store_tile)
from .chunk_intra import Prepared

WY_BWD_BKS = 32
WY_BWD_BVS = 16
WY_BWD_WARPS = 4
"""Key slice, value slice and warps of ``qed_bwd_wy_kernel``. Four warps, not eight: Triton 3.6's
sm_90 build of the eight-warp kernel reads shared memory out of bounds (float32) or gives wrong
``dv, dw, dA_kk`` (bf16), found by a launch screen on an H200 (CHANGELOG.md, "Measurement history")."""

SCORES_BWD_BKS = 32
SCORES_BWD_WARPS = 4
"""Key slice and warps of ``qed_bwd_scores_kernel``, by rule: its tiles are ``[BC, BKS]`` =
``[16, 32]`` (4 elements a thread at four warps), its work elementwise on them and ``[16, 16] x
[16, 32]`` products, with one reduction (a block's sum of ``dkg kg`` over its 16 rows) made once.
Slices of 32 as fla's intra backward; 64 would halve the re-reads of ``dA`` (once per key slice)
at a third more registers (``bench/chunk_aot.py bwd``)."""

DG_BWD_BKS = 32
DG_BWD_WARPS = 4
"""Key slice and warps of ``qed_bwd_dg_kernel``: one ``[BT, 32]`` tile of ``dG`` per program (16
elements a thread), read once and written once as ``dg``."""


@triton.jit
def _diag_terms(gc, qs, kh, a, daqk, dakk, G, r_s, rI, mI, nI, cols, m_c, c_I, HV: tl.constexpr, K: tl.constexpr,
                BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr):
    """Score terms of the diagonal block (rows ``rI`` = ``r_s + 0..BC-1``, the first ``nI`` valid;
    ``G`` their ``[BC, BKS]`` tile; ``c_I`` the block's first column in ``dA``): ``dqs, da`` of
    its rows from its columns and ``dk`` of its rows from its rows, with exact decays.

    Step ``i`` loads row ``i`` of ``G, k_hat, qs, a`` (``[BKS]``) and column ``i`` and row ``i``
    of the block of ``dA_qk, dA_kk`` (``[BC]``), and forms one tile of decays
    ``E[r] = e^{-|G_r - G_i|}``: ``e^{G_r - G_i}`` for ``r >= i``, ``e^{G_i - G_r}`` for ``r <= i``
    (``G`` does not increase), every one <= 1. Then per element
    ``dx_r += dA[r,i] k_i E[r]`` (the terms ``r >= i``) and
    ``dk_r += (dA_qk[i,r] qs_i + dA_kk[i,r] a_i) E[r]`` (the terms ``r <= i``): the other half of
    each is zero as loaded, as ``dA_qk`` is stored with zeros above the diagonal and ``dA_kk``
    strictly lower; rows past the end have ``dA`` masked to 0.
    """
    o_c = tl.arange(0, BC)
    dq = G * 0.
    da = G * 0.
    dk = G * 0.
    for i in range(nI):
        r_i = (r_s + i) * (HV * K) + cols
        g_i = tl.load(gc + r_i, mask=m_c, other=0.).to(DT)
        k_i = tl.load(kh + r_i, mask=m_c, other=0.).to(DT)
        q_i = tl.load(qs + r_i, mask=m_c, other=0.).to(DT)
        a_i = tl.load(a + r_i, mask=m_c, other=0.).to(DT)
        colq = tl.load(daqk + rI * (HV * BT) + c_I + i, mask=mI, other=0.).to(DT)
        cola = tl.load(dakk + rI * (HV * BT) + c_I + i, mask=mI, other=0.).to(DT)
        rowq = tl.load(daqk + (r_s + i) * (HV * BT) + c_I + o_c).to(DT)
        rowa = tl.load(dakk + (r_s + i) * (HV * BT) + c_I + o_c).to(DT)
        E = exp(-tl.abs(G - g_i[None, :]))
        ke = E * k_i[None, :]
        dq += colq[:, None] * ke
        da += cola[:, None] * ke
        dk += E * (rowq[:, None] * q_i[None, :] + rowa[:, None] * a_i[None, :])
    return dq, da, dk


@triton.jit
def _earlier_blocks(gc, kh, daqk, dakk, G, gs, r0, eos, rI, mI, I, cols, m_c, HV: tl.constexpr, K: tl.constexpr,
                    BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """``dqs, da`` of row block ``I`` from the column blocks ``J < I``:
    ``e^{G_t - G_s} sum_J dA_IJ (k_J e^{G_s - G_J})`` with ``s`` the block's first row (``gs``
    its ``G``), both factors <= 1; products at ``PREC``."""
    o_c = tl.arange(0, BC)
    accq = G * 0.
    acca = G * 0.
    for J in range(I):
        rJ = r0 + J * BC + o_c
        mJ = rJ < eos
        ke = load_tile(kh, rJ, mJ, cols, m_c, HV * K, DT) * exp(gs[None, :] - load_tile(gc, rJ, mJ, cols, m_c,
                                                                                            HV * K, DT))
        cJ = J * BC + o_c
        accq += tl.dot(load_tile(daqk, rI, mI, cJ, cJ < BT, HV * BT, DT), ke, input_precision=PREC)
        acca += tl.dot(load_tile(dakk, rI, mI, cJ, cJ < BT, HV * BT, DT), ke, input_precision=PREC)
    e = exp(tl.where(mI[:, None], G - gs[None, :], float("-inf")))
    return e * accq, e * acca


@triton.jit
def _later_blocks(gc, qs, a, daqk, dakk, G, gn, r0, eos, mI, I, nb, cols, m_c, HV: tl.constexpr, K: tl.constexpr,
                  BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """``dk`` of row block ``I`` from the row blocks ``I2 > I`` (of the chunk's ``nb`` with rows):
    ``e^{G_n - G_j} sum_I2 dA_{I2,I}^T (x_I2 e^{G_I2 - G_n})`` summed over ``(x, dA) = (qs, dA_qk),
    (a, dA_kk)``, with ``n`` the block's last row (``gn`` its ``G``), both factors <= 1;
    ``dA_{I2,I}^T`` is loaded transposed; products at ``PREC``."""
    o_c = tl.arange(0, BC)
    cI = I * BC + o_c
    acc = G * 0.
    for I2 in range(I + 1, nb):
        r2 = r0 + I2 * BC + o_c
        m2 = r2 < eos
        e2 = exp(tl.where(m2[:, None], load_tile(gc, r2, m2, cols, m_c, HV * K, DT) - gn[None, :], float("-inf")))
        dAq = tl.load(daqk + r2[None, :] * (HV * BT) + cI[:, None], mask=m2[None, :], other=0.).to(DT)
        dAa = tl.load(dakk + r2[None, :] * (HV * BT) + cI[:, None], mask=m2[None, :], other=0.).to(DT)
        acc += tl.dot(dAq, load_tile(qs, r2, m2, cols, m_c, HV * K, DT) * e2, input_precision=PREC)
        acc += tl.dot(dAa, load_tile(a, r2, m2, cols, m_c, HV * K, DT) * e2, input_precision=PREC)
    return exp(tl.where(mI[:, None], gn[None, :] - G, float("-inf"))) * acc


@triton.heuristics({"IS_VARLEN": lambda args: args["cu_seqlens"] is not None})
@triton.jit(do_not_specialize=["T"])
def qed_bwd_wy_kernel(
    ai, w, u, r, hs, dh, do, dr, v, w_gate, dqg, dkg, dgl, dag, daqk, dakk, dv, dw,
    cu_seqlens, chunk_indices, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr,
    BVS: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk: ``d(wv)`` (written as ``dv = d(wv) w_gate``, ``dw = d(wv) v``), ``dA_qk``,
    ``dqg, dkg, dgamma``, ``d(a e^G)`` and ``dA_kk``: every term that sums over the value axis or
    over all keys. Products take their operands in the dtype of ``ai`` and accumulate in ``DT``."""
    i_hv, i_t, i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN, False)
    o_t = tl.arange(0, BT)
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    ai, daqk, dakk = shifted((ai, daqk, dakk), i_hv * BT)
    Tm = load_tile(ai, rows, m_t, o_t, o_t < BT, HV * BT, ai.dtype.element_ty)  # zero above the diagonal
    OP = Tm.dtype

    # ---- over value blocks: d(wv) = Tm^T dR (an output), dA_kk -= d(wv) U^T, dA_qk = dO R^T
    b_dakk = tl.zeros([BT, BT], dtype=DT)
    b_daqk = tl.zeros([BT, BT], dtype=DT)
    u, r, do, dr, v, w_gate, dv, dw = shifted((u, r, do, dr, v, w_gate, dv, dw), i_hv * V)
    for i_v in range(tl.cdiv(V, BVS)):
        cols, m_c = channel_slice(i_v, BVS, V)
        b_dwv = tl.dot(tl.trans(Tm), load_tile(dr, rows, m_t, cols, m_c, HV * V, DT).to(OP), input_precision=PREC)
        store_tile(dv, b_dwv * load_tile(w_gate, rows, m_t, cols, m_c, HV * V, DT), rows, m_t, cols, m_c, HV * V)
        store_tile(dw, b_dwv * load_tile(v, rows, m_t, cols, m_c, HV * V, DT), rows, m_t, cols, m_c, HV * V)
        b_dakk -= tl.dot(b_dwv.to(OP), tl.trans(load_tile(u, rows, m_t, cols, m_c, HV * V, DT).to(OP)),
                         input_precision=PREC)
        b_daqk += tl.dot(load_tile(do, rows, m_t, cols, m_c, HV * V, DT).to(OP),
                         tl.trans(load_tile(r, rows, m_t, cols, m_c, HV * V, DT).to(OP)), input_precision=PREC)
    store_tile(daqk, tl.where(o_t[:, None] >= o_t[None, :], b_daqk, 0.), rows, m_t, o_t, o_t < BT, HV * BT)

    # ---- over key slices: dqg, dkg, dgamma, dW (sums over value blocks with S0, dS1), then
    # d(a e^G) = Tm^T dW and dA_kk -= d(a e^G) W^T
    w, dqg, dkg, dag = shifted((w, dqg, dkg, dag), i_hv * K)
    p_s = (i_g * HV + i_hv) * K * V
    for i_k in range(tl.cdiv(K, BKS)):
        cols, m_c = channel_slice(i_k, BKS, K)
        b_dqg = tl.zeros([BT, BKS], dtype=DT)
        b_dkg = tl.zeros([BT, BKS], dtype=DT)
        b_dw = tl.zeros([BT, BKS], dtype=DT)
        b_dgam = tl.zeros([BKS], dtype=DT)
        for i_v in range(tl.cdiv(V, BVS)):
            cv, m_v = channel_slice(i_v, BVS, V)
            s0 = load_tile(hs + p_s, cols, m_c, cv, m_v, V, DT)
            ds1 = load_tile(dh + p_s, cols, m_c, cv, m_v, V, DT)
            b_dqg += tl.dot(load_tile(do, rows, m_t, cv, m_v, HV * V, DT).to(OP), tl.trans(s0.to(OP)),
                            input_precision=PREC)
            b_dw -= tl.dot(load_tile(dr, rows, m_t, cv, m_v, HV * V, DT).to(OP), tl.trans(s0.to(OP)),
                           input_precision=PREC)
            b_dkg += tl.dot(load_tile(r, rows, m_t, cv, m_v, HV * V, DT).to(OP), tl.trans(ds1.to(OP)),
                            input_precision=PREC)
            b_dgam += tl.sum(s0 * ds1, 1)
        store_tile(dqg, b_dqg, rows, m_t, cols, m_c, HV * K)
        store_tile(dkg, b_dkg, rows, m_t, cols, m_c, HV * K)
        tl.store(dgl + (i_g * HV + i_hv) * K + cols, b_dgam.to(dgl.dtype.element_ty), mask=m_c)
        b_dag = tl.dot(tl.trans(Tm), b_dw.to(OP), input_precision=PREC)
        store_tile(dag, b_dag, rows, m_t, cols, m_c, HV * K)
        b_dakk -= tl.dot(b_dag.to(OP), tl.trans(load_tile(w, rows, m_t, cols, m_c, HV * K, DT).to(OP)),
                         input_precision=PREC)
    store_tile(dakk, tl.where(o_t[:, None] > o_t[None, :], b_dakk, 0.), rows, m_t, o_t, o_t < BT, HV * BT)


@triton.heuristics({"IS_VARLEN": lambda args: args["cu_seqlens"] is not None})
@triton.jit(do_not_specialize=["T"])
def qed_bwd_scores_kernel(
    gc, qs, kh, a, daqk, dakk, dqg, dkg, dag, dq, dk, da, dgc, dgk,
    cu_seqlens, chunk_indices, T, scale,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr,
    IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Row block ``I`` of one chunk on one key slice ``i_k``, grid ``(chunks x BT // BC x key
    slices, B * HV)`` with the blocks and slices of a chunk next to each other in axis 0 (so the
    programs that re-read a chunk's tiles run together): the block's score terms
    (:func:`_diag_terms`, :func:`_earlier_blocks`, :func:`_later_blocks`) and elementwise terms.
    Writes ``dq, dk, da`` and ``dgc`` (``dG``) on the block's rows and ``dgk`` (``[NC, HV, BT //
    BC, K]``): the block's sum over its rows of ``dkg kg``, a term of ``dG_last``."""
    NB: tl.constexpr = BT // BC
    NK: tl.constexpr = (K + BKS - 1) // BKS
    i_x = tl.program_id(0)
    i_hv, i_t, i_g, bos, eos = chunk_at(i_x // (NB * NK), tl.program_id(1), cu_seqlens, chunk_indices, T, HV, BT,
                                        IS_VARLEN)
    I = i_x % NB
    i_k = (i_x // NB) % NK
    r0 = bos + i_t * BT
    r_s = r0 + I * BC
    if r_s >= eos:
        return
    daqk, dakk = shifted((daqk, dakk), i_hv * BT)
    gc, qs, kh, a, dqg, dkg, dag, dq, dk, da, dgc = shifted((gc, qs, kh, a, dqg, dkg, dag, dq, dk, da, dgc), i_hv * K)
    o_c = tl.arange(0, BC)
    rI = r_s + o_c
    mI = rI < eos
    nI = tl.minimum(eos - r_s, BC)                     # valid rows of the block
    nb = tl.cdiv(tl.minimum(eos - r0, BT), BC)         # row blocks of the chunk with rows
    cols, m_c = channel_slice(i_k, BKS, K)
    S: tl.constexpr = HV * K
    G = load_tile(gc, rI, mI, cols, m_c, S, DT)
    b_qs = load_tile(qs, rI, mI, cols, m_c, S, DT)
    b_kh = load_tile(kh, rI, mI, cols, m_c, S, DT)
    b_a = load_tile(a, rI, mI, cols, m_c, S, DT)
    gs = tl.load(gc + r_s * S + cols, mask=m_c, other=0.).to(DT)                     # block's first row
    gn = tl.load(gc + (r_s + nI - 1) * S + cols, mask=m_c, other=0.).to(DT)          # its last
    g_last = tl.load(gc + (tl.minimum(r0 + BT, eos) - 1) * S + cols, mask=m_c, other=0.).to(DT)  # chunk's last

    dqs, das, dks = _diag_terms(gc, qs, kh, a, daqk, dakk, G, r_s, rI, mI, nI, cols, m_c, I * BC, HV, K, BT, BC, DT)
    eq, ea = _earlier_blocks(gc, kh, daqk, dakk, G, gs, r0, eos, rI, mI, I, cols, m_c, HV, K, BT, BC, DT, PREC)
    dqs += eq
    das += ea
    dks += _later_blocks(gc, qs, a, daqk, dakk, G, gn, r0, eos, mI, I, nb, cols, m_c, HV, K, BT, BC, DT, PREC)

    # ---- elementwise terms
    eg = exp(tl.where(mI[:, None], G, float("-inf")))
    ekl = exp(tl.where(mI[:, None], g_last[None, :] - G, float("-inf")))
    b_dqg = load_tile(dqg, rI, mI, cols, m_c, S, DT)
    b_dkg = load_tile(dkg, rI, mI, cols, m_c, S, DT)
    b_dag = load_tile(dag, rI, mI, cols, m_c, S, DT)
    kgd = b_dkg * b_kh * ekl
    dG = (b_dqg * b_qs + b_dag * b_a) * eg - kgd + b_qs * dqs + b_a * das - b_kh * dks
    store_tile(dq, (b_dqg * eg + dqs) * scale, rI, mI, cols, m_c, S)
    store_tile(da, b_dag * eg + das, rI, mI, cols, m_c, S)
    store_tile(dk, b_dkg * ekl + dks, rI, mI, cols, m_c, S)
    store_tile(dgc, dG, rI, mI, cols, m_c, S)
    tl.store(dgk + ((i_g * HV + i_hv) * NB + I) * K + cols, tl.sum(kgd, 0).to(dgk.dtype.element_ty), mask=m_c)


@triton.heuristics({"IS_VARLEN": lambda args: args["cu_seqlens"] is not None})
@triton.jit(do_not_specialize=["T"])
def qed_bwd_dg_kernel(
    dgc, dgk, dgl, gl, dg, cu_seqlens, chunk_indices, T,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr,
    IS_VARLEN: tl.constexpr, DT: tl.constexpr,
):
    """Per chunk and key slice ``program_id(2)``: ``dg_t = sum_{s >= t} dG_s + dG_last`` from
    ``qed_bwd_scores_kernel``'s ``dG`` rows (``dgc``), with ``dG_last`` = its row blocks' sums of
    ``dkg kg`` (``dgk``, only blocks with rows) + ``dgamma gamma`` (``dgl``, and ``gl`` = ``gamma
    = e^{G_last}`` from the prep)."""
    NB: tl.constexpr = BT // BC
    i_hv, i_t, i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN, False)
    cols, m_c = channel_slice(tl.program_id(2), BKS, K)
    r0 = bos + i_t * BT
    rows = r0 + tl.arange(0, BT)
    m_t = rows < eos
    o_b = tl.arange(0, NB)
    p = i_g * HV + i_hv
    part = tl.load(dgk + (p * NB + o_b[:, None]) * K + cols[None, :],
                   mask=(r0 + o_b * BC < eos)[:, None] & m_c[None, :], other=0.).to(DT)
    d_last = (tl.sum(part, 0) + tl.load(dgl + p * K + cols, mask=m_c, other=0.).to(DT)
              * tl.load(gl + p * K + cols, mask=m_c, other=0.).to(DT))
    dG = load_tile(dgc + i_hv * K, rows, m_t, cols, m_c, HV * K, DT)
    store_tile(dg + i_hv * K, tl.cumsum(dG, 0, reverse=True) + d_last[None, :], rows, m_t, cols, m_c, HV * K)


@dataclass(frozen=True)
class WYGrads:
    """What ``qed_bwd_wy_kernel`` writes: ``dv, dw`` (the gradients of the values and the write
    gate, ``[B, T, HV, V]``, in their dtypes) and, in the state dtype, ``dqg, dkg, dag`` (of
    ``qg``, ``kg``, ``a e^G``, ``[B, T, HV, K]``), ``dgl`` (``dgamma``, ``[NC, HV, K]``) and
    ``daqk, dakk`` (of the score matrices, ``[B, T, HV, BT]``)."""

    dqg: torch.Tensor
    dkg: torch.Tensor
    dag: torch.Tensor
    dv: torch.Tensor
    dw: torch.Tensor
    dgl: torch.Tensor
    daqk: torch.Tensor
    dakk: torch.Tensor


def chunk_bwd_wy(lay: ChunkLayout, *, ai, w, u, r, hs, dh, do, dr, v, w_gate) -> WYGrads:
    """Launch ``qed_bwd_wy_kernel`` (grid: chunks x value heads) on the forward's ``ai, w, u``
    and residuals ``r``, the chunk-start states ``hs`` and chunk-end state gradients ``dh``
    (``[NC, HV, K, V]``), ``do``, the residual gradient ``dr``, the values and the write gate."""
    B, T, HV, K = w.shape
    V = u.shape[-1]
    ct, dev = lay.state_dtype, w.device
    bk = lambda n: torch.empty(B, T, HV, n, device=dev, dtype=ct)  # noqa: E731
    out = WYGrads(dqg=bk(K), dkg=bk(K), dag=bk(K), dv=torch.empty_like(v), dw=torch.empty_like(w_gate), dgl=torch.empty(lay.NC, HV, K, device=dev, dtype=ct),
                  daqk=bk(BT), dakk=bk(BT))
    qed_bwd_wy_kernel[lay.grid](
        ai=ai, w=w, u=u, r=r, hs=hs, dh=dh, do=do, dr=dr, v=v, w_gate=w_gate, dqg=out.dqg, dkg=out.dkg,
        dgl=out.dgl, dag=out.dag, daqk=out.daqk, dakk=out.dakk, dv=out.dv, dw=out.dw, cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T,
        HV=HV, K=K, V=V, BT=BT, BKS=min(WY_BWD_BKS, triton.next_power_of_2(K)),
        BVS=min(WY_BWD_BVS, triton.next_power_of_2(V)), DT=lay.DT, PREC=lay.prec, num_warps=WY_BWD_WARPS,
        num_stages=1,
    )
    return out


def chunk_bwd_scores(lay: ChunkLayout, prep: Prepared, *, g, wy_grads: WYGrads, scale: float):
    """Launch ``qed_bwd_scores_kernel`` (grid: chunks x ``BT // BC`` row blocks x key slices,
    value heads) on the backward prep's ``G, qs, k_hat, a`` (``Prepared.gc, qs, kh, a``) and
    :func:`chunk_bwd_wy`'s gradients, then ``qed_bwd_dg_kernel`` (grid: chunks x value heads x
    key slices); returns ``(dq_hat, dk_hat, da, dg)`` per value head ``[B, T, HV, K]`` (state
    dtype; ``dg`` in the dtype of the log-decay ``g``)."""
    B, T, HV, K = g.shape
    NB = BT // BC
    if NB * BC != BT or NB & (NB - 1):
        raise ValueError(f"qed_bwd_scores_kernel splits a chunk of BT = {BT} rows into a power of two of "
                         f"BC = {BC}-row blocks")
    if prep.kh is None:
        raise ValueError("chunk_bwd_scores needs the prep's qs, kh, a (chunk_prep_fwd(..., hats=True))")
    ct, dev = lay.state_dtype, g.device
    BKS = min(SCORES_BWD_BKS, triton.next_power_of_2(K))
    dq, dk, da, dgc = (torch.empty(B, T, HV, K, device=dev, dtype=ct) for _ in range(4))
    dgk = torch.empty(lay.NC, HV, NB, K, device=dev, dtype=ct)
    w = wy_grads
    qed_bwd_scores_kernel[(lay.grid[0] * NB * triton.cdiv(K, BKS), lay.grid[1])](
        gc=prep.gc, qs=prep.qs, kh=prep.kh, a=prep.a, daqk=w.daqk, dakk=w.dakk, dqg=w.dqg, dkg=w.dkg, dag=w.dag,
        dq=dq, dk=dk, da=da, dgc=dgc, dgk=dgk, cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T,
        scale=scale, HV=HV, K=K, BT=BT, BC=BC, BKS=BKS, DT=lay.DT, PREC=lay.prec, num_warps=SCORES_BWD_WARPS,
        num_stages=1,
    )
    dg = torch.empty_like(g)
    BKS = min(DG_BWD_BKS, triton.next_power_of_2(K))
    qed_bwd_dg_kernel[(*lay.grid, triton.cdiv(K, BKS))](
        dgc=dgc, dgk=dgk, dgl=w.dgl, gl=prep.gl, dg=dg, cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices,
        T=T, HV=HV, K=K, BT=BT, BC=BC, BKS=BKS, DT=lay.DT, num_warps=DG_BWD_WARPS, num_stages=1,
    )
    return dq, dk, da, dg
