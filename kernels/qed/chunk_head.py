r"""Score matrices of ``qed_chunk`` for a per-head decay: ``g`` ``[B, T, HV]``, one log-decay per
token and value head (Gated DeltaNet's), the same for every key channel.

With a per-head decay the within-chunk decay of a pair is one scalar, ``e^{G_t - G_j}`` (``G`` the
within-chunk cumsum of ``g``, ``[BT]``), so every score matrix is a plain Gram matrix times one
``[BT, BT]`` decay matrix, as fla's ``chunk_scaled_dot_kkt`` forms ``beta_t (k_t . k_j)
e^{G_t - G_j}``::

    A_kk[t,j] = (a_t . k_j) e^{G_t - G_j}          j < t     (a = b k_hat + lam d, the erase vector)
    A_qk[t,j] = scale (q_t . k_j) e^{G_t - G_j}    j <= t
    A_dk[t,j] = (d_t . k_j) e^{G_t - G_j}          j < t     (probes only)

``qed_head_scores_kernel``: one program per chunk and value head walks the key axis in slices of
``BKS``, builds ``q_hat, k_hat, a, d`` of the slice from the raw ``q, k``, the erase gate (per
channel or per head) and the row scalars the prep kernel stored (``chunk_intra.erase_from``: every
arm, a given ``d``), and accumulates the three ``[BT, BT]`` products; the decay matrix multiplies
them once at the end. Each exponent ``G_t - G_j`` (``j <= t``) is ``<= 0``, so nothing overflows,
whatever the decay; the pairs ``j > t`` are set to 0 before the exponential. Its outputs are those of
``chunk_intra.qed_scores_kernel`` (:class:`chunk_intra.Scores`), which the per-channel decay needs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_common import BT, ChunkLayout, channel_slice, chunk_position, exp, store_tile
from .chunk_intra import (SCORES_SWITCHES, DirectionInputs, Prepared, Scores, direction_source, erase_from,
                          head_pointers, row_scalars, slice_rows)

def head_scores_config(K: int, probes: bool, state_dtype: torch.dtype) -> tuple[int, int]:
    """``(BKS, num_warps)`` of the per-head-decay scores kernel, by rule (no autotuning): 4 warps,
    key slices of 64 without probes and of 32 with them (the third ``[64, 64]`` accumulator leaves
    no registers for wider slices) or in float64; on an H100 the fastest of slices 32 / 64 x 4 / 8
    warps x 1 / 2 stages (docs/BENCHMARKS.md)."""
    wide = probes or state_dtype == torch.float64
    return min(32 if wide else 64, triton.next_power_of_2(K)), 4


@triton.heuristics(SCORES_SWITCHES)
@triton.jit(do_not_specialize=["T"])
def qed_head_scores_kernel(
    q, k, b, lam, z, d_in, gc, rq, rk, cp,
    aqk, akk, adk,
    cu_seqlens, chunk_indices, T, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr,
    DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
    LAM_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr, PROBES: tl.constexpr, B_HEAD: tl.constexpr,
):
    i_hv, i_t, _i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    q, k, b, lam = head_pointers(q, k, b, lam, i_hv, H, HV, K, B_HEAD)
    if z is not None:
        z += i_hv * K
    if d_in is not None:
        d_in += i_hv * K
    o_t = tl.arange(0, BT)
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    rq_t, rk_t, c_t, l_t = row_scalars(rq + i_hv, rk + i_hv, cp + i_hv, lam, rows, m_t, HV, LAM_TOKEN, DT)
    G = tl.load(gc + rows * HV + i_hv, mask=m_t, other=0.).to(DT)

    accq = tl.zeros([BT, BT], dtype=DT)
    acck = tl.zeros([BT, BT], dtype=DT)
    accd = tl.zeros([BT, BT], dtype=DT)
    for i_k in range(tl.cdiv(K, BKS)):
        cols, m_c = channel_slice(i_k, BKS, K)
        r_q, r_k, r_b = slice_rows(q, k, b, rows, m_t, i_k, H, HV, K, BKS, B_HEAD)
        src = direction_source(z, d_in, rows, m_t, cols, m_c, HV, K, DIR_SOURCE)
        b_q, b_k, b_a, b_d = erase_from(r_q.to(DT), r_k.to(DT), r_b.to(DT), src, rq_t, rk_t, c_t, l_t, DIR_SOURCE,
                                        DIR_GATED, DT)
        kt = tl.trans(b_k)
        accq += tl.dot(b_q, kt, input_precision=PREC)
        acck += tl.dot(b_a, kt, input_precision=PREC)
        if PROBES:
            accd += tl.dot(b_d, kt, input_precision=PREC)

    causal = o_t[:, None] >= o_t[None, :]
    strict = o_t[:, None] > o_t[None, :]
    dec = exp(tl.where(causal, G[:, None] - G[None, :], 0.))
    off = i_hv * BT
    m_all = o_t < BT
    store_tile(aqk + off, tl.where(causal, accq * dec, 0.) * scale, rows, m_t, o_t, m_all, HV * BT)
    store_tile(akk + off, tl.where(strict, acck * dec, 0.), rows, m_t, o_t, m_all, HV * BT)
    if PROBES:
        store_tile(adk + off, tl.where(strict, accd * dec, 0.), rows, m_t, o_t, m_all, HV * BT)


def chunk_head_scores_fwd(x: DirectionInputs, prep: Prepared, *, scale: float, lay: ChunkLayout,
                          inter_dtype: torch.dtype, probes: bool) -> Scores:
    """Launch ``qed_head_scores_kernel`` (grid: chunks x value heads) on the prep's per-head ``G``
    (``prep.gc`` ``[B, T, HV]``); the whole ``[BT, BT]`` block of each chunk is written (zeros above
    the diagonal)."""
    B, T, HV = prep.gc.shape
    K = x.q.shape[-1]
    dev = prep.gc.device
    out = Scores(aqk=torch.empty(B, T, HV, BT, device=dev, dtype=inter_dtype),
                 akk=torch.empty(B, T, HV, BT, device=dev, dtype=lay.state_dtype),
                 adk=torch.empty(B, T, HV, BT, device=dev, dtype=inter_dtype) if probes else None)
    BKS, num_warps = head_scores_config(K, probes, lay.state_dtype)
    qed_head_scores_kernel[lay.grid](
        q=x.q, k=x.k, b=x.b, lam=x.lam, z=x.z, d_in=x.d, gc=prep.gc, rq=prep.rq, rk=prep.rk, cp=prep.cp,
        aqk=out.aqk, akk=out.akk, adk=out.adk,
        cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T, scale=scale,
        H=x.q.shape[2], HV=HV, K=K, BT=BT, BKS=BKS,
        DIR_SOURCE=x.flags["DIR_SOURCE"], DIR_GATED=x.flags["DIR_GATED"], DT=lay.DT, PREC=lay.prec,
        num_warps=num_warps, num_stages=1,
    )
    return out
