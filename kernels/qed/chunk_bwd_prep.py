r"""Backward of the ``qed_chunk`` preparation: from the gradients of the normalised query and key
and of the erase vector to those of the raw inputs (the mirror of ``chunk_intra.qed_prep_kernel``).

Per row (token and value head; notation of ``arms.py``: ``q_hat = rq q``, ``k_hat = rk k``, ``x0``
the raw direction (``q_hat``, ``z``, the given ``d`` or 0), ``x = b x0`` when gated, ``c = k_hat .
x`` when projected (else 0), ``d = x - c k_hat``, ``a = b k_hat + lam d``), given ``gq, gk, ga``
(the gradients of ``q_hat, k_hat, a`` per value head)::

    dlam = ga . d                       gd = lam ga
    projected:  gc = -(gd . k_hat),  gx = gd + gc k_hat,  gk += gc x - c gd     else gx = gd
    db = ga k_hat + (gated) gx x0       gx0 = b gx (gated) or gx
    gk += b ga;  gq += gx0 (source q);  dd = gx0 (source d)
    dq = rq (Gq - q_hat (q_hat . Gq)),  dk = rk (Gk - k_hat (k_hat . Gk))     (L2 norm; else Gq, Gk)

with ``Gq, Gk`` the sums of ``gq, gk`` over the value heads of a query/key head (grouped heads).
One program per chunk and query/key head walks its group's value heads: per value head a pass
over the key slices for the row dot products, a pass for the per-value-head outputs (``db``,
``dd``, ``dlam``) that adds ``gq, gk`` into ``dq, dk``; then (L2 norm) a last pass applies the
norm's backward in place. The per-row ``rq, rk, c`` are the forward prep's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_common import BT, ChunkLayout, channel_slice, chunk_position, load_tile, store_tile
from .chunk_intra import erase_rows, raw_direction, row_scalars

PREP_BWD_BKS = 16
PREP_BWD_WARPS = 8
"""Key slice and warps of ``qed_prep_bwd_kernel``, by rule: about ten ``[64, BKS]`` tiles are live
at once, 16-channel slices in 8 warps hold them in 64 registers a thread; 8 warps timed faster than
4 or 2 (docs/BENCHMARKS.md)."""


@triton.jit
def _head_dots(q, k, b, z, d_in, ga, rows, m_t, rq, rk, c, lam_r, H: tl.constexpr, HV: tl.constexpr,
               K: tl.constexpr, BKS: tl.constexpr, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr,
               DT: tl.constexpr):
    """Row sums over all K of one value head: ``(ga . d, ga . k_hat)``."""
    s_d = rq * 0.
    s_k = rq * 0.
    for i_k in range(tl.cdiv(K, BKS)):
        cols, m_c = channel_slice(i_k, BKS, K)
        _q, b_k, _a, b_d = erase_rows(q, k, b, z, d_in, rows, m_t, cols, m_c, rq, rk, c, lam_r,
                                      H, HV, K, DIR_SOURCE, DIR_GATED, DT)
        b_ga = load_tile(ga, rows, m_t, cols, m_c, HV * K, DT)
        s_d += tl.sum(b_ga * b_d, 1)
        s_k += tl.sum(b_ga * b_k, 1)
    return s_d, s_k


@triton.heuristics({
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
    "LAM_TOKEN": lambda args: args["lam"].dim() == 3,
    "STORE_DD": lambda args: args["dd"] is not None,
})
@triton.jit(do_not_specialize=["T"])
def qed_prep_bwd_kernel(
    q, k, b, lam, z, d_in, rq, rk, cp, gq, gk, ga, dq, dk, db, dd, dlam,
    cu_seqlens, chunk_indices, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr,
    L2NORM: tl.constexpr, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr, DIR_PROJECTED: tl.constexpr,
    DT: tl.constexpr, LAM_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr, STORE_DD: tl.constexpr,
):
    i_h, i_t, _i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN, False)
    rows = bos + i_t * BT + tl.arange(0, BT)
    m_t = rows < eos
    q, k, dq, dk = q + i_h * K, k + i_h * K, dq + i_h * K, dk + i_h * K
    G: tl.constexpr = HV // H
    s_q = tl.zeros([BT], dtype=DT)
    s_k = tl.zeros([BT], dtype=DT)
    for j in tl.static_range(G):
        i_hv = i_h * G + j
        off = i_hv * K
        b_j, ga_j, gq_j, gk_j, db_j = b + off, ga + off, gq + off, gk + off, db + off
        z_j = z
        d_j = d_in
        if z is not None:
            z_j = z + off
        if d_in is not None:
            d_j = d_in + off
        b_rq, b_rk, b_c, lam_r = row_scalars(rq + i_hv, rk + i_hv, cp + i_hv, lam + i_hv, rows, m_t, HV,
                                             LAM_TOKEN, DT)
        s_d, s_gk = _head_dots(q, k, b_j, z_j, d_j, ga_j, rows, m_t, b_rq, b_rk, b_c, lam_r, H, HV, K, BKS,
                               DIR_SOURCE, DIR_GATED, DT)
        tl.store(dlam + rows * HV + i_hv, s_d.to(dlam.dtype.element_ty), mask=m_t)
        gc = -lam_r * s_gk
        for i_k in range(tl.cdiv(K, BKS)):
            cols, m_c = channel_slice(i_k, BKS, K)
            b_q, b_k, _a, _d = erase_rows(q, k, b_j, z_j, d_j, rows, m_t, cols, m_c, b_rq, b_rk, b_c, lam_r,
                                          H, HV, K, DIR_SOURCE, DIR_GATED, DT)
            b_b = load_tile(b_j, rows, m_t, cols, m_c, HV * K, DT)
            x0 = raw_direction(b_q, b_b, z_j, d_j, rows, m_t, cols, m_c, HV, K, DIR_SOURCE, False, DT)
            b_ga = load_tile(ga_j, rows, m_t, cols, m_c, HV * K, DT)
            b_gq = load_tile(gq_j, rows, m_t, cols, m_c, HV * K, DT)
            b_gk = load_tile(gk_j, rows, m_t, cols, m_c, HV * K, DT) + b_b * b_ga
            gx = lam_r[:, None] * b_ga
            if DIR_PROJECTED:
                x = b_b * x0 if DIR_GATED else x0
                b_gk += gc[:, None] * x - b_c[:, None] * gx
                gx += gc[:, None] * b_k
            b_db = b_ga * b_k
            if DIR_GATED:
                b_db += gx * x0
                gx = gx * b_b
            if DIR_SOURCE == "q":
                b_gq += gx
            if STORE_DD:
                store_tile(dd + off, gx, rows, m_t, cols, m_c, HV * K)
            store_tile(db_j, b_db, rows, m_t, cols, m_c, HV * K)
            if j > 0:
                b_gq += load_tile(dq, rows, m_t, cols, m_c, H * K, DT)
                b_gk += load_tile(dk, rows, m_t, cols, m_c, H * K, DT)
            store_tile(dq, b_gq, rows, m_t, cols, m_c, H * K)
            store_tile(dk, b_gk, rows, m_t, cols, m_c, H * K)
            if j == G - 1:
                s_q += tl.sum(b_q * b_gq, 1)
                s_k += tl.sum(b_k * b_gk, 1)
        tl.debug_barrier()
    if L2NORM:
        b_rq, b_rk, _c, _lam = row_scalars(rq + i_h * G, rk + i_h * G, cp + i_h * G, lam + i_h * G, rows, m_t, HV,
                                           LAM_TOKEN, DT)
        for i_k in range(tl.cdiv(K, BKS)):
            cols, m_c = channel_slice(i_k, BKS, K)
            b_q = load_tile(q, rows, m_t, cols, m_c, H * K, DT) * b_rq[:, None]
            b_k = load_tile(k, rows, m_t, cols, m_c, H * K, DT) * b_rk[:, None]
            b_gq = load_tile(dq, rows, m_t, cols, m_c, H * K, DT)
            b_gk = load_tile(dk, rows, m_t, cols, m_c, H * K, DT)
            store_tile(dq, b_rq[:, None] * (b_gq - b_q * s_q[:, None]), rows, m_t, cols, m_c, H * K)
            store_tile(dk, b_rk[:, None] * (b_gk - b_k * s_k[:, None]), rows, m_t, cols, m_c, H * K)


def chunk_prep_bwd(x, lay: ChunkLayout, *, rq, rk, cp, gq, gk, ga):
    """Launch ``qed_prep_bwd_kernel`` (grid: chunks x query/key heads).

    ``x``: the call's ``chunk_intra.DirectionInputs``; ``rq, rk, cp``: the forward prep's row
    scalars ``[B, T, HV]``; ``gq, gk, ga``: the gradients of ``q_hat, k_hat, a`` per value head
    ``[B, T, HV, K]``. Returns ``(dq, dk, db, dd, dlam)``: ``dq, dk`` ``[B, T, H, K]`` and
    ``dlam`` per token ``[B, T, HV]`` (whatever the shape of ``lam``) in the state dtype, ``db``
    ``[B, T, HV, K]`` and ``dd`` (when ``d`` was given, else ``None``) in the dtypes of ``b, d``.
    """
    B, T, H, K = x.q.shape
    HV = x.b.shape[2]
    ct, dev = lay.state_dtype, gq.device
    dq, dk = (torch.empty(B, T, H, K, device=dev, dtype=ct) for _ in range(2))
    db = torch.empty_like(x.b)
    dd = torch.empty_like(x.d) if x.d is not None else None
    dlam = torch.empty(B, T, HV, device=dev, dtype=ct)
    grid = (lay.grid[0], lay.grid[1] // (HV // H))
    qed_prep_bwd_kernel[grid](
        q=x.q, k=x.k, b=x.b, lam=x.lam, z=x.z, d_in=x.d, rq=rq, rk=rk, cp=cp, gq=gq, gk=gk, ga=ga,
        dq=dq, dk=dk, db=db, dd=dd, dlam=dlam, cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T,
        H=H, HV=HV, K=K, BT=BT, BKS=min(PREP_BWD_BKS, triton.next_power_of_2(K)), L2NORM=x.l2norm, **x.flags,
        DT=lay.DT, num_warps=PREP_BWD_WARPS, num_stages=1,
    )
    return dq, dk, db, dd, dlam
