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

Two kernels, each behind a typed wrapper: ``qed_bwd_wy_kernel`` (:func:`chunk_bwd_wy`, one
program per chunk and value head: every product over the value axis or over all keys, into
:class:`WYGrads`), then ``qed_bwd_scores_kernel`` (:func:`chunk_bwd_scores`, one program per
chunk, value head and key slice of ``BKS`` channels: the rest is channel-local once ``dA`` is
known). The scores kernel walks the chunk's ``BC = 16``-token row blocks from the last: each
block's score terms (off-diagonal blocks as tensor-core products with a reference point inside
the pair, both decay factors <= 1; diagonal blocks with exact per-element decays
``e^{G_t - G_j} <= 1``, ``t >= j``; so any ``g <= 0`` is safe), its elementwise terms, and its
rows of ``dg`` with the later blocks' sum of ``dG`` carried, so every output is written once.
Outputs: ``dq_hat`` (= ``scale dqs``), ``dk_hat``, ``da``, ``dg``, and ``dv, dw`` from ``d(wv)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .chunk_common import BC, BT, ChunkLayout, channel_slice, chunk_position, load_tile, shifted, store_tile, tile_row
from .chunk_intra import DirectionInputs, Prepared, erase_rows, row_scalars

WY_BWD_BKS = 32
WY_BWD_BVS = 16
WY_BWD_WARPS = 4
"""Key slice, value slice and warps of ``qed_bwd_wy_kernel``. Four warps, not eight: Triton 3.6's
sm_90 build of the eight-warp kernel reads shared memory out of bounds (float32) or gives wrong
``dv, dw, dA_kk`` (bf16), found with ``scripts/h200_bwd_configs.sh``; at four it spills
(docs/BENCHMARKS.md)."""

SCORES_BWD_BKS = 32
SCORES_BWD_WARPS = 1
"""Key slice and warps of ``qed_bwd_scores_kernel``, by rule: one warp per ``[16, 32]`` tile.
The kernel's tiles are ``BC x BKS`` (16 tokens by 32 channels) and its diagonal blocks reduce
over a tile's rows and columns at every one of their 16 steps; with more warps than the tile
needs, each reduction crosses warps through shared memory and a barrier, so fewer warps are
faster (``scripts/bwd_config_timing.py``; docs/BENCHMARKS.md has the screen). Its row blocks are
walked by runtime loops: unrolled, they needed more registers than 8 warps have."""


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
def _block_G(g, g_f, rows, m_r, cols, m_c, o_t, J, HV: tl.constexpr, K: tl.constexpr,
             BC: tl.constexpr, DT: tl.constexpr):
    """The within-chunk cumsum ``G`` on row block ``J`` (``BC`` tokens) of the chunk's ``g_f``."""
    prefix = tl.sum(tl.where(o_t[:, None] < J * BC, g_f, 0.), 0)
    return tl.cumsum(load_tile(g, rows, m_r, cols, m_c, HV * K, DT), 0) + prefix[None, :]


@triton.jit
def _k_hat(k, rk, rows, m_r, cols, m_c, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, DT: tl.constexpr):
    """The normalised key ``k_hat = rk k`` on ``[rows, cols]`` (``rk`` this value head's)."""
    r = tl.load(rk + rows * HV, mask=m_r, other=0.).to(DT)
    return load_tile(k, rows, m_r, cols, m_c, H * K, DT) * r[:, None]


@triton.jit
def _hats(q, k, b, z, d_in, rq, rk, cp, lam, rows, m_r, cols, m_c, H: tl.constexpr, HV: tl.constexpr,
          K: tl.constexpr, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr, LAM_TOKEN: tl.constexpr,
          DT: tl.constexpr):
    """``q_hat, k_hat`` and the erase vector ``a`` on ``[rows, cols]``, rebuilt from the raw inputs
    and the forward prep's row scalars (as ``chunk_intra.qed_scores_kernel`` does)."""
    b_rq, b_rk, b_c, b_lam = row_scalars(rq, rk, cp, lam, rows, m_r, HV, LAM_TOKEN, DT)
    b_q, b_k, b_a, _d = erase_rows(q, k, b, z, d_in, rows, m_r, cols, m_c, b_rq, b_rk, b_c, b_lam, H, HV, K,
                                   DIR_SOURCE, DIR_GATED, DT)
    return b_q, b_k, b_a


@triton.jit
def _dblock(D, rows, m_r, I, J, H: tl.constexpr, BT: tl.constexpr,
            BC: tl.constexpr, DT: tl.constexpr):
    """Block ``(I, J)`` (``BC x BC``) of a ``[BT, BT]``-per-chunk score gradient."""
    cols = J * BC + tl.arange(0, BC)
    return load_tile(D, rows, m_r, cols, cols < BT, H * BT, DT)


@triton.jit
def _block_terms(q, k, b, z, d_in, rq, rk, cp, lam, g, DAQK, DAKK, g_f, r0, eos, cols, m_c, o_t, scale,
                 I, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                 BC: tl.constexpr, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr, LAM_TOKEN: tl.constexpr,
                 DT: tl.constexpr, PREC: tl.constexpr):
    """Score-term gradients of row block ``I``: ``dqs, da`` (from column blocks ``J <= I``) and
    ``dk`` (from row blocks ``I' >= I``), returned with the block's ``qs, k_hat, a, G`` tiles.

    Off-diagonal blocks are products with the reference point ``s`` = first row of the later
    block: ``e^{G_t - G_j} = e^{G_t - G_s} e^{G_s - G_j}``, both factors <= 1; diagonal blocks use
    exact per-element decays (:func:`_score_terms`).
    """
    o_c = tl.arange(0, BC)
    rI = r0 + I * BC + o_c
    mI = rI < eos
    qI, kI, aI = _hats(q, k, b, z, d_in, rq, rk, cp, lam, rI, mI, cols, m_c, H, HV, K, DIR_SOURCE, DIR_GATED,
                       LAM_TOKEN, DT)
    qI = qI * scale
    GI = _block_G(g, g_f, rI, mI, cols, m_c, o_t, I, HV, K, BC, DT)
    causal = o_c[:, None] >= o_c[None, :]
    dq, da, dk = _score_terms(qI, kI, aI, GI,
                              tl.where(causal, _dblock(DAQK, rI, mI, I, I, HV, BT, BC, DT), 0.),
                              tl.where(o_c[:, None] > o_c[None, :], _dblock(DAKK, rI, mI, I, I, HV, BT, BC, DT), 0.),
                              o_c, BC)
    sI = tile_row(GI, 0, BC)
    accq = dq * 0.
    acca = dq * 0.
    for J in range(I):
        rJ = r0 + J * BC + o_c
        mJ = rJ < eos
        GJ = _block_G(g, g_f, rJ, mJ, cols, m_c, o_t, J, HV, K, BC, DT)
        ke = _k_hat(k, rk, rJ, mJ, cols, m_c, H, HV, K, DT) * tl.exp(sI[None, :] - GJ)
        accq += tl.dot(_dblock(DAQK, rI, mI, I, J, HV, BT, BC, DT), ke, input_precision=PREC)
        acca += tl.dot(_dblock(DAKK, rI, mI, I, J, HV, BT, BC, DT), ke, input_precision=PREC)
    eI = tl.exp(GI - sI[None, :])
    dq += eI * accq
    da += eI * acca
    for I2 in range(I + 1, BT // BC):
        r2 = r0 + I2 * BC + o_c
        m2 = r2 < eos
        q2, _k2, a2 = _hats(q, k, b, z, d_in, rq, rk, cp, lam, r2, m2, cols, m_c, H, HV, K, DIR_SOURCE, DIR_GATED,
                            LAM_TOKEN, DT)
        G2 = _block_G(g, g_f, r2, m2, cols, m_c, o_t, I2, HV, K, BC, DT)
        s2 = tile_row(G2, 0, BC)
        e2 = tl.exp(G2 - s2[None, :])
        acc = (tl.dot(tl.trans(_dblock(DAQK, r2, m2, I2, I, HV, BT, BC, DT)), q2 * scale * e2, input_precision=PREC)
               + tl.dot(tl.trans(_dblock(DAKK, r2, m2, I2, I, HV, BT, BC, DT)), a2 * e2, input_precision=PREC))
        dk += tl.exp(s2[None, :] - GI) * acc
    return dq, da, dk, qI, kI, aI, GI


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
    i_hv, i_t, i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    ai, daqk, dakk = shifted((ai, daqk, dakk), i_hv * BT)
    Tm = tl.load(ai + rows[:, None] * (HV * BT) + o_t[None, :],
                 mask=m_t[:, None] & (o_t[None, :] <= o_t[:, None]), other=0.)
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


@triton.jit
def _chunk_dgl(k, rk, dkg, dgl, g_f, rows, m_t, cols, m_c, i_g, i_hv, H: tl.constexpr, HV: tl.constexpr,
               K: tl.constexpr, DT: tl.constexpr):
    """``dG_last`` of the chunk's key slice, ``sum_t dkg k_hat e^{G_last - G} + dgamma gamma``, and
    ``G_last``."""
    G = tl.cumsum(g_f, 0)
    gl = tl.sum(g_f, 0)
    ekl = tl.where(m_t[:, None], tl.exp(gl[None, :] - G), 0.)
    kgd = load_tile(dkg, rows, m_t, cols, m_c, HV * K, DT) * _k_hat(k, rk, rows, m_t, cols, m_c, H, HV, K, DT) * ekl
    dgam = tl.load(dgl + (i_g * HV + i_hv) * K + cols, mask=m_c, other=0.).to(DT)
    return tl.sum(kgd, 0) + dgam * tl.exp(gl), gl


@triton.heuristics({
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
    "LAM_TOKEN": lambda args: args["lam"].dim() == 3,
})
@triton.jit(do_not_specialize=["T"])
def qed_bwd_scores_kernel(
    q, k, b, lam, z, d_in, rq, rk, cp, g, daqk, dakk, dqg, dkg, dgl, dag, dq, dk, da, dg,
    cu_seqlens, chunk_indices, T, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr,
    DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr, LAM_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk and key slice ``i_k = program_id(2)``, row block by row block from the last:
    the score terms, the elementwise terms, and ``dg`` as the reverse cumsum of ``dG`` (the
    later blocks' sum carried) plus ``dG_last``. ``q_hat, k_hat, a`` are rebuilt from the raw
    inputs and the forward prep's row scalars; the outputs are per value head."""
    i_hv, i_t, i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    i_k = tl.program_id(2)
    o_t = tl.arange(0, BT)
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    daqk, dakk = shifted((daqk, dakk), i_hv * BT)
    q, k = shifted((q, k), (i_hv // (HV // H)) * K)
    b, g, dqg, dkg, dag, dq, dk, da, dg = shifted((b, g, dqg, dkg, dag, dq, dk, da, dg), i_hv * K)
    rq, rk, cp, lam = shifted((rq, rk, cp, lam), i_hv)
    if z is not None:
        z += i_hv * K
    if d_in is not None:
        d_in += i_hv * K
    r0 = bos + i_t * BT
    cols, m_c = channel_slice(i_k, BKS, K)
    g_f = load_tile(g, rows, m_t, cols, m_c, HV * K, DT)
    dG_last, gl = _chunk_dgl(k, rk, dkg, dgl, g_f, rows, m_t, cols, m_c, i_g, i_hv, H, HV, K, DT)
    carry = dG_last
    o_c = tl.arange(0, BC)
    for i_b in range(BT // BC):
        I = BT // BC - 1 - i_b
        dqp, dap, dkp, qs, kh, ah, G = _block_terms(q, k, b, z, d_in, rq, rk, cp, lam, g, daqk, dakk, g_f, r0, eos,
                                                   cols, m_c, o_t, scale, I, H, HV, K, BT, BC, DIR_SOURCE,
                                                   DIR_GATED, LAM_TOKEN, DT, PREC)
        rI = r0 + I * BC + o_c
        mI = rI < eos
        eg = tl.where(mI[:, None], tl.exp(G), 0.)
        ekl = tl.where(mI[:, None], tl.exp(gl[None, :] - G), 0.)
        b_dqg = load_tile(dqg, rI, mI, cols, m_c, HV * K, DT)
        b_dkg = load_tile(dkg, rI, mI, cols, m_c, HV * K, DT)
        b_dag = load_tile(dag, rI, mI, cols, m_c, HV * K, DT)
        dG = (b_dqg * qs + b_dag * ah) * eg - b_dkg * kh * ekl + qs * dqp + ah * dap - kh * dkp
        store_tile(dq, (b_dqg * eg + dqp) * scale, rI, mI, cols, m_c, HV * K)
        store_tile(da, b_dag * eg + dap, rI, mI, cols, m_c, HV * K)
        store_tile(dk, b_dkg * ekl + dkp, rI, mI, cols, m_c, HV * K)
        store_tile(dg, tl.cumsum(dG, 0, reverse=True) + carry[None, :], rI, mI, cols, m_c, HV * K)
        carry += tl.sum(dG, 0)


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


def chunk_bwd_scores(lay: ChunkLayout, x: DirectionInputs, prep: Prepared, *, g, wy_grads: WYGrads, scale: float):
    """Launch ``qed_bwd_scores_kernel`` (grid: chunks x value heads x key slices) on the call's
    direction inputs ``x``, the forward prep's row scalars, the log-decay ``g`` ``[B, T, HV, K]``
    and :func:`chunk_bwd_wy`'s gradients; returns ``(dq_hat, dk_hat, da, dg)`` per value head
    ``[B, T, HV, K]`` (state dtype; ``dg`` in ``g``'s)."""
    B, T, HV, K = g.shape
    BKS = min(SCORES_BWD_BKS, triton.next_power_of_2(K))
    dq, dk, da = (torch.empty(B, T, HV, K, device=g.device, dtype=lay.state_dtype) for _ in range(3))
    dg = torch.empty_like(g)
    w = wy_grads
    qed_bwd_scores_kernel[(*lay.grid, triton.cdiv(K, BKS))](
        q=x.q, k=x.k, b=x.b, lam=x.lam, z=x.z, d_in=x.d, rq=prep.rq, rk=prep.rk, cp=prep.cp, g=g,
        daqk=w.daqk, dakk=w.dakk, dqg=w.dqg, dkg=w.dkg, dgl=w.dgl, dag=w.dag, dq=dq, dk=dk, da=da, dg=dg,
        cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T, scale=scale,
        H=x.q.shape[2], HV=HV, K=K, BT=BT, BC=BC, BKS=BKS, DIR_SOURCE=x.flags["DIR_SOURCE"],
        DIR_GATED=x.flags["DIR_GATED"], DT=lay.DT, PREC=lay.prec, num_warps=SCORES_BWD_WARPS, num_stages=1,
    )
    return dq, dk, da, dg
