r"""Intra-chunk kernels of ``qed_chunk``, part 1: per-token preparation and the score matrices
(see ``chunk.py`` for the algorithm, ``chunk_wy.py`` for the inverse and the WY factors).

``G`` is the within-chunk inclusive cumsum of ``g`` (per channel); chunks have ``BT = 64``
tokens; key channels are read in slices of ``BKS`` so that K up to 256 fits.

``qed_prep_kernel`` (one program per chunk and value head; token-parallel work):

1. row statistics over all of K: ``|q|^2, |k|^2, q.k, sum b k^2`` and ``k.x`` (``x`` the arm's
   raw direction); from them the per-row scalars ``rq, rk`` (L2-norm factors) and ``c`` (the
   projection coefficient), and the probes ``rho, e``.
2. per key slice: ``G``, ``kg = k exp(G_last - G)``, ``qg = scale q exp(G)``, ``ag = a exp(G)``
   (``a = b k + lam d``, the erase vector), the chunk decay ``exp(G_last)``; with probes ``d``
   and ``dg = d exp(G)``; for the backward (``HATS``) also ``scale q``, ``k`` and ``a`` (the
   backward's scores kernel loads them instead of rebuilding them; the forward does not write them).
   The decay is per channel (a per-head decay with a per-head ``b`` takes the scalar-gate path,
   ``scalar_gram.py``). A per-head ``b`` (``B_HEAD``, KDA's ``beta``) is one scalar per row
   broadcast over the slice (``chunk_common.gate_tile``).

Both passes walk the key slices with the next slice's loads issued before the current slice's
work (its raw ``q, k, b``, and ``g`` in pass 2, held in registers across the iteration; pass 1's
last prefetch is pass 2's first slice), so each program has two slices of loads in flight and
their latency overlaps the work on the slice before, instead of each slice waiting for its own
loads.

``qed_scores_kernel`` (one program per 16-token row block, chunk and value head): one
``[16, 64]`` row block of each score matrix ``A_xk[t, j] = sum_c x_{t,c} e^{G_{t,c} - G_{j,c}}
k_{j,c}``: ``A_kk`` (``x = a``, strict), ``A_qk`` (``x = scale q``, inclusive) and, with probes,
``A_dk`` (``x = d``, strict). The reference point is the block's first row ``s``:
``x_t e^{G_t - G_s}`` and ``k_j e^{G_s - G_j}``; for earlier blocks both factors are <= 1 (never
overflow); the diagonal block uses the same product when its decay span (max over the block's
rows and all K) is at most ``SPAN_MAX`` nats, otherwise exact per-element exponentials.

Its two walks over the key slices, the span (``G`` at the block's first and last rows) and the
products (per slice: ``G`` at the reference row; ``G`` and raw ``k`` of the key rows; ``G``, raw
``q, k, b`` and the direction source of the block's rows), issue the next slice's loads before the
current slice's work and hold them, in their stored dtypes, across the iteration; slice 0 of the
products is issued before the span walk. Each program so has two slices of loads in flight, and
their latency overlaps the work on the slice before. Past the last slice the prefetch is masked
off (it reads nothing). Only the exact diagonal path, taken for spans over ``SPAN_MAX``, still
reads its key rows one at a time.

Grouped value heads: a program of value head ``i_hv`` reads query/key head ``i_hv // (HV // H)``
(row stride ``H * K``); everything else is per value head (row stride ``HV * K``). The arm is the
compile-time description of ``arms.direction_flags``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .chunk_common import (BC, BT, ChunkLayout, channel_slice, chunk_at, chunk_axes, chunk_position, exp, gate_head, gate_tile,
                           heads_first, load_tile, store_tile)

SPAN_MAX = 30.0
"""Largest within-block decay span (nats) for which a diagonal block uses the reference-point
product; beyond it the block is built from exact per-element exponentials."""
PREP_BKS = 32
"""Key slice of the prep kernel: ``[64, 32]`` tiles, twice the bytes per load of 16; faster than
16, and than 64 or 128 in 8 warps, with probes off and on (docs/BENCHMARKS.md)."""
SCORES_BKS = 16
"""Key slice of the scores kernel (``[16, 16]`` row tiles, ``[64, 16]`` key tiles)."""
PREP_MAXNREG = 168
"""Register cap (ptxas ``.maxnreg``) of the forward prep without probes: three programs per SM
instead of ptxas' two, for a few bytes of spills; the prep with probes or with the backward's
outputs spills far more under the cap and keeps ptxas' choice (figures and timings in
docs/BENCHMARKS.md). None leaves every launch to ptxas."""

def prep_maxnreg(probes: bool, hats: bool) -> int | None:
    """The prep launch's register cap: :data:`PREP_MAXNREG` for the forward without probes, else
    None (ptxas' choice)."""
    return None if (probes or hats) else PREP_MAXNREG


PREP_WARPS = 4
SCORES_WARPS = 4
"""Warps of the two kernels, by rule (no autotuning: a call's configuration depends only on its
arguments' sizes and dtypes, never on earlier calls; ptxas figures in docs/BENCHMARKS.md)."""


# ------------------------------------------------------------------- direction and erase vector
@triton.jit
def direction_source(z, d_in, rows, m_r, cols, m_c, HV: tl.constexpr, K: tl.constexpr,
                     DIR_SOURCE: tl.constexpr):
    """What the arm's direction reads on one ``[rows, cols]`` slice, in its stored dtype: ``z``
    (this value head's, ``[cols]``), the given ``d`` tile, or, for a direction from ``q`` or none,
    a placeholder (nothing is read). Apart from :func:`direction_of` so that it can be prefetched."""
    if DIR_SOURCE == "z":
        src = tl.load(z + cols, mask=m_c, other=0.)
    elif DIR_SOURCE == "d":
        src = load_tile(d_in, rows, m_r, cols, m_c, HV * K, d_in.dtype.element_ty)
    else:
        src = tl.zeros_like(cols)
    return src


@triton.jit
def direction_of(q, b_b, src, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr, DT: tl.constexpr):
    """The arm's unnormalised, unprojected direction ``x`` on one slice, from ``q`` (already
    scaled by its norm factor, or raw) or the loaded ``src`` (:func:`direction_source`), gated
    by ``b`` for the gated arms."""
    if DIR_SOURCE == "z":
        x = q * 0. + src.to(DT)[None, :]
    elif DIR_SOURCE == "d":
        x = src.to(DT)
    elif DIR_SOURCE == "q":
        x = q
    else:
        x = q * 0.
    if DIR_GATED:
        x = b_b * x
    return x


@triton.jit
def raw_direction(q, b_b, z, d_in, rows, m_r, cols, m_c, HV: tl.constexpr, K: tl.constexpr,
                   DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr, DT: tl.constexpr):
    """:func:`direction_of` with its source loaded from ``z`` or ``d_in`` on the ``[rows, cols]``
    slice."""
    return direction_of(q, b_b, direction_source(z, d_in, rows, m_r, cols, m_c, HV, K, DIR_SOURCE), DIR_SOURCE,
                        DIR_GATED, DT)


@triton.jit
def slice_rows(q, k, b, rows, m_r, i_k, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                BKS: tl.constexpr, B_HEAD: tl.constexpr):
    """Key slice ``i_k`` of the raw ``q, k`` (query/key head) and ``b`` rows (a per-head ``b``
    broadcast over the slice), in their stored dtype (held across a loop iteration as a prefetch,
    converted where used)."""
    cols, m_c = channel_slice(i_k, BKS, K)
    return (load_tile(q, rows, m_r, cols, m_c, H * K, q.dtype.element_ty),
            load_tile(k, rows, m_r, cols, m_c, H * K, k.dtype.element_ty),
            gate_tile(b, rows, m_r, cols, m_c, HV, K, B_HEAD, b.dtype.element_ty))


@triton.jit
def _stats(b_q, b_k, b_b, b_x):
    """Per-row sums over one key slice of raw ``q, k, b`` and the raw direction ``x``:
    ``|q|^2, |k|^2, q.k, sum b k^2, k.x``."""
    return (tl.sum(b_q * b_q, 1), tl.sum(b_k * b_k, 1), tl.sum(b_k * b_q, 1), tl.sum(b_b * b_k * b_k, 1),
            tl.sum(b_k * b_x, 1))


@triton.jit
def _scalars(qq, kk, kq, bkk, kx, lam_r, L2NORM: tl.constexpr, DIR_SOURCE: tl.constexpr,
             DIR_PROJECTED: tl.constexpr):
    """Per-row factors ``rq, rk`` (L2 norm), ``c`` (projection coefficient), ``rho`` and ``e``."""
    if L2NORM:
        rq = 1. / tl.sqrt(qq + 1e-6)
        rk = 1. / tl.sqrt(kk + 1e-6)
    else:
        rq = qq * 0. + 1.
        rk = kk * 0. + 1.
    rho = kq * rq * rk
    kxh = kx * rk * rq if DIR_SOURCE == "q" else kx * rk    # k_hat . x_hat
    c = kxh if DIR_PROJECTED else kxh * 0.
    dk = kxh - c * (kk * rk * rk)                            # k_hat . d
    e = 1. - bkk * rk * rk - lam_r * dk
    return rq, rk, c, rho, e


@triton.jit
def erase_from(b_q, b_k, b_b, src, rq, rk, c, lam_r, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr,
               DT: tl.constexpr):
    """Normalised ``q, k``, the direction ``d = x - c k`` and the erase vector ``a = b k + lam d``
    on one slice, from the raw ``q, k, b`` tiles of that slice (as ``DT``) and the loaded
    direction source ``src`` (:func:`direction_source`)."""
    b_q = b_q * rq[:, None]
    b_k = b_k * rk[:, None]
    b_d = direction_of(b_q, b_b, src, DIR_SOURCE, DIR_GATED, DT) - c[:, None] * b_k
    b_a = b_b * b_k + lam_r[:, None] * b_d
    return b_q, b_k, b_a, b_d


@triton.jit
def erase_tiles(b_q, b_k, b_b, z, d_in, rows, m_r, cols, m_c, rq, rk, c, lam_r, HV: tl.constexpr,
                K: tl.constexpr, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr, DT: tl.constexpr):
    """:func:`erase_from` with the direction source loaded for the ``[rows, cols]`` slice."""
    return erase_from(b_q, b_k, b_b, direction_source(z, d_in, rows, m_r, cols, m_c, HV, K, DIR_SOURCE), rq, rk, c,
                      lam_r, DIR_SOURCE, DIR_GATED, DT)


@triton.jit
def erase_rows(q, k, b, z, d_in, rows, m_r, cols, m_c, rq, rk, c, lam_r, H: tl.constexpr,
                HV: tl.constexpr, K: tl.constexpr, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr,
                DT: tl.constexpr):
    """:func:`erase_tiles` on the ``[rows, cols]`` slice loaded from ``q, k, b``."""
    return erase_tiles(load_tile(q, rows, m_r, cols, m_c, H * K, DT), load_tile(k, rows, m_r, cols, m_c, H * K, DT),
                       load_tile(b, rows, m_r, cols, m_c, HV * K, DT), z, d_in, rows, m_r, cols, m_c, rq, rk, c,
                       lam_r, HV, K, DIR_SOURCE, DIR_GATED, DT)


@triton.jit
def row_lam(lam, r, m, HV: tl.constexpr, LAM_TOKEN: tl.constexpr, DT: tl.constexpr):
    """lambda of rows ``r`` (mask ``m``) of one value head (``lam`` shifted to it): per token
    ``lam[r * HV]``, or the head's ``lam[0]``."""
    if LAM_TOKEN:
        out = tl.load(lam + r * HV, mask=m, other=0.).to(DT)
    else:
        out = tl.zeros_like(r).to(DT) + tl.load(lam).to(DT)
    return out


@triton.jit
def row_scalars(RQ, RK, CP, lam, r, m, HV: tl.constexpr, LAM_TOKEN: tl.constexpr, DT: tl.constexpr):
    """The per-row scalars the prep kernel stored (``rq, rk, c``) and lambda, for rows ``r``."""
    rq = tl.load(RQ + r * HV, mask=m, other=0.).to(DT)
    rk = tl.load(RK + r * HV, mask=m, other=0.).to(DT)
    c = tl.load(CP + r * HV, mask=m, other=0.).to(DT)
    return rq, rk, c, row_lam(lam, r, m, HV, LAM_TOKEN, DT)


@triton.jit
def head_pointers(q, k, b, lam, i_hv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, B_HEAD: tl.constexpr):
    """The direction inputs moved to value head ``i_hv`` (``q, k`` to its query/key head; ``b``
    per channel or per head, :func:`gate_head`).

    The optional ``z`` and ``d_in`` are moved by the caller: a Triton function cannot return an
    absent (``None``) pointer."""
    i_h = i_hv // (HV // H)
    q += i_h * K
    k += i_h * K
    b = gate_head(b, i_hv, K, B_HEAD)
    lam += i_hv
    return q, k, b, lam


# ------------------------------------------------------------------------------- prep kernel
@triton.heuristics({
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
    "PROBES": lambda args: args["rho"] is not None,
    "HATS": lambda args: args["kh"] is not None,
    "LAM_TOKEN": lambda args: args["lam"].dim() == 3,
    "B_HEAD": lambda args: args["b"].dim() == 3,
})
@triton.jit(do_not_specialize=["T"])
def qed_prep_kernel(
    q, k, b, g, lam, z, d_in,
    rq, rk, cp, gc, kg, qg, ag, gl, dg, rho, eig, d_out, qs, kh, a_out,
    cu_seqlens, chunk_indices, T, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr,
    L2NORM: tl.constexpr, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr, DIR_PROJECTED: tl.constexpr,
    DT: tl.constexpr, LAM_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr, PROBES: tl.constexpr,
    HATS: tl.constexpr, B_HEAD: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    i_hv, i_t, i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN, HEADS_FIRST)
    rows = bos + i_t * BT + tl.arange(0, BT)
    m_t = rows < eos
    q, k, b, lam = head_pointers(q, k, b, lam, i_hv, H, HV, K, B_HEAD)
    if z is not None:
        z += i_hv * K
    if d_in is not None:
        d_in += i_hv * K
    lam_f = row_lam(lam, rows, m_t, HV, LAM_TOKEN, DT)

    # ---- 1: row statistics over all of K, per-row scalars, probes rho and e. Each iteration
    # first issues the loads of the next key slice (after the last: slice 0, where pass 2 starts)
    NK: tl.constexpr = (K + BKS - 1) // BKS
    qq = tl.zeros([BT], dtype=DT)
    kk = tl.zeros([BT], dtype=DT)
    kq = tl.zeros([BT], dtype=DT)
    bkk = tl.zeros([BT], dtype=DT)
    kx = tl.zeros([BT], dtype=DT)
    r_q, r_k, r_b = slice_rows(q, k, b, rows, m_t, 0, H, HV, K, BKS, B_HEAD)
    for i_k in range(NK):
        cols, m_c = channel_slice(i_k, BKS, K)
        n_q, n_k, n_b = slice_rows(q, k, b, rows, m_t, (i_k + 1) % NK, H, HV, K, BKS, B_HEAD)
        b_q, b_k, b_b = r_q.to(DT), r_k.to(DT), r_b.to(DT)
        s_qq, s_kk, s_kq, s_bkk, s_kx = _stats(b_q, b_k, b_b, raw_direction(b_q, b_b, z, d_in, rows, m_t, cols, m_c, HV,
                                                                            K, DIR_SOURCE, DIR_GATED, DT))
        qq += s_qq
        kk += s_kk
        kq += s_kq
        bkk += s_bkk
        kx += s_kx
        r_q, r_k, r_b = n_q, n_k, n_b
    off = i_hv * K
    p_row = rows * HV + i_hv
    g += i_hv * K
    cols, m_c = channel_slice(0, BKS, K)
    r_g = load_tile(g, rows, m_t, cols, m_c, HV * K, DT)
    b_rq, b_rk, b_c, b_rho, b_e = _scalars(qq, kk, kq, bkk, kx, lam_f, L2NORM, DIR_SOURCE, DIR_PROJECTED)
    tl.store(rq + p_row, b_rq.to(rq.dtype.element_ty), mask=m_t)
    tl.store(rk + p_row, b_rk.to(rk.dtype.element_ty), mask=m_t)
    tl.store(cp + p_row, b_c.to(cp.dtype.element_ty), mask=m_t)
    if PROBES:
        tl.store(rho + p_row, b_rho.to(rho.dtype.element_ty), mask=m_t)
        tl.store(eig + p_row, b_e.to(eig.dtype.element_ty), mask=m_t)

    # ---- 2: G, kg, qg, ag, (dg, d), (scale q, k, a) per key slice, chunk decay e^{G_last}; the
    # next slice's loads first (the last iteration reloads its own)
    for i_k in range(NK):
        cols, m_c = channel_slice(i_k, BKS, K)
        i_n = tl.minimum(i_k + 1, NK - 1)
        n_q, n_k, n_b = slice_rows(q, k, b, rows, m_t, i_n, H, HV, K, BKS, B_HEAD)
        c_n, m_n = channel_slice(i_n, BKS, K)
        n_g = load_tile(g, rows, m_t, c_n, m_n, HV * K, DT)
        b_q, b_k, b_a, b_d = erase_tiles(r_q.to(DT), r_k.to(DT), r_b.to(DT), z, d_in, rows, m_t, cols, m_c, b_rq,
                                         b_rk, b_c, lam_f, HV, K, DIR_SOURCE, DIR_GATED, DT)
        b_G = tl.cumsum(r_g, 0)
        b_glast = tl.sum(r_g, 0)
        b_ex = exp(b_G)
        store_tile(gc + off, b_G, rows, m_t, cols, m_c, HV * K)
        store_tile(kg + off, b_k * exp(b_glast[None, :] - b_G), rows, m_t, cols, m_c, HV * K)
        store_tile(qg + off, b_q * b_ex * scale, rows, m_t, cols, m_c, HV * K)
        store_tile(ag + off, b_a * b_ex, rows, m_t, cols, m_c, HV * K)
        tl.store(gl + (i_g * HV + i_hv) * K + cols, exp(b_glast).to(gl.dtype.element_ty), mask=m_c)
        if PROBES:
            store_tile(dg + off, b_d * b_ex, rows, m_t, cols, m_c, HV * K)
            store_tile(d_out + off, b_d, rows, m_t, cols, m_c, HV * K)
        if HATS:
            store_tile(qs + off, b_q * scale, rows, m_t, cols, m_c, HV * K)
            store_tile(kh + off, b_k, rows, m_t, cols, m_c, HV * K)
            store_tile(a_out + off, b_a, rows, m_t, cols, m_c, HV * K)
        r_q, r_k, r_b = n_q, n_k, n_b
        r_g = n_g


@dataclass(frozen=True)
class DirectionInputs:
    """What the erase vector ``a = b k_hat + lam d`` is built from, as the kernels take it:
    contiguous ``q, k`` ``[B, T, H, K]``, ``b`` ``[B, T, HV, K]``, ``lam`` ``[HV]`` or
    ``[B, T, HV]`` in the state dtype, ``z`` ``[HV, K]`` or ``None``, the given ``d``
    ``[B, T, HV, K]`` or ``None``, the arm's compile-time ``flags`` (``arms.direction_flags``) and
    whether ``q, k`` are L2-normalised."""

    q: torch.Tensor
    k: torch.Tensor
    b: torch.Tensor
    lam: torch.Tensor
    z: torch.Tensor | None
    d: torch.Tensor | None
    flags: dict
    l2norm: bool


@dataclass(frozen=True)
class Prepared:
    """What ``qed_prep_kernel`` writes. Per row ``[B, T, HV]`` (state dtype): ``rq, rk`` (norm
    factors), ``cp`` (projection coefficient); per row and key channel ``[B, T, HV, K]``: ``gc``
    (``G``, state dtype), ``kg``, ``qg``, ``ag`` and (probes) ``dg`` (intermediate dtype); ``gl``
    ``[NC, HV, K]`` (``exp(G_last)``). Probes (else ``None``): ``rho, e`` ``[B, T, HV]`` and ``d``
    ``[B, T, HV, K]`` in the state dtype. For the backward (``hats``, else ``None``): ``qs = scale
    q_hat``, ``kh = k_hat`` and the erase vector ``a``, ``[B, T, HV, K]`` in the state dtype."""

    rq: torch.Tensor
    rk: torch.Tensor
    cp: torch.Tensor
    gc: torch.Tensor
    kg: torch.Tensor
    qg: torch.Tensor
    ag: torch.Tensor
    gl: torch.Tensor
    dg: torch.Tensor | None
    rho: torch.Tensor | None
    e: torch.Tensor | None
    d: torch.Tensor | None
    qs: torch.Tensor | None
    kh: torch.Tensor | None
    a: torch.Tensor | None


def chunk_prep_fwd(x: DirectionInputs, g: torch.Tensor, *, scale: float, lay: ChunkLayout,
                   inter_dtype: torch.dtype, probes: bool, hats: bool = False) -> Prepared:
    """Launch ``qed_prep_kernel`` (grid: value heads x chunks, :func:`~.chunk_common.heads_first`)
    and return its outputs; ``qs, kh, a`` are written only with ``hats`` (the backward's rerun of
    the prep, for its scores kernel)."""
    B, T, HV = g.shape[:3]
    K = x.q.shape[-1]
    ct, dev = lay.state_dtype, g.device
    row = lambda: torch.empty(B, T, HV, device=dev, dtype=ct)  # noqa: E731
    bk = lambda dt: torch.empty(B, T, HV, K, device=dev, dtype=dt)  # noqa: E731
    out = Prepared(rq=row(), rk=row(), cp=row(), gc=bk(ct), kg=bk(inter_dtype),
                   qg=bk(inter_dtype), ag=bk(inter_dtype), gl=torch.empty(lay.NC, HV, K, device=dev, dtype=ct),
                   dg=bk(inter_dtype) if probes else None, rho=row() if probes else None,
                   e=row() if probes else None, d=bk(ct) if probes else None,
                   qs=bk(ct) if hats else None, kh=bk(ct) if hats else None, a=bk(ct) if hats else None)
    grid, first = heads_first(lay.grid)
    qed_prep_kernel[grid](
        q=x.q, k=x.k, b=x.b, g=g, lam=x.lam, z=x.z, d_in=x.d,
        rq=out.rq, rk=out.rk, cp=out.cp, gc=out.gc, kg=out.kg, qg=out.qg, ag=out.ag, gl=out.gl, dg=out.dg,
        rho=out.rho, eig=out.e, d_out=out.d, qs=out.qs, kh=out.kh, a_out=out.a,
        cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T, scale=scale,
        H=x.q.shape[2], HV=HV, K=K, BT=BT, BKS=min(PREP_BKS, triton.next_power_of_2(K)),
        L2NORM=x.l2norm, **x.flags, DT=lay.DT, HEADS_FIRST=first, num_warps=PREP_WARPS, num_stages=1,
        maxnreg=prep_maxnreg(probes, hats),
    )
    return out


# ----------------------------------------------------------------------------- scores kernel
@triton.jit
def _span_rows(gc, r_s, r_e, i_k, HV: tl.constexpr, K: tl.constexpr, BKS: tl.constexpr):
    """Key slice ``i_k`` of ``G`` at a row block's first and last rows ``r_s, r_e`` (``[BKS]``
    each, stored dtype; past the last slice the loads are masked off and read nothing)."""
    cols, m_c = channel_slice(i_k, BKS, K)
    return (tl.load(gc + r_s * (HV * K) + cols, mask=m_c, other=0.),
            tl.load(gc + r_e * (HV * K) + cols, mask=m_c, other=0.))


@triton.jit
def _score_slice(q, k, b, z, d_in, gc, rows, jm, r_i, m_i, r_s, i_k, H: tl.constexpr, HV: tl.constexpr,
                 K: tl.constexpr, BKS: tl.constexpr, DIR_SOURCE: tl.constexpr, B_HEAD: tl.constexpr):
    """Every load the scores kernel makes for key slice ``i_k``, in the stored dtypes (held across
    a loop iteration as a prefetch, converted where used; past the last slice the loads are
    masked off and read nothing): ``G`` at the reference row (``[BKS]``), ``G`` and the raw ``k``
    of the key rows ``rows`` (``[BT, BKS]``, mask ``jm``), ``G`` and the raw ``q, k, b`` of the
    block's rows ``r_i`` (``[BC, BKS]``) and the direction source of those rows."""
    cols, m_c = channel_slice(i_k, BKS, K)
    r_q, r_k, r_b = slice_rows(q, k, b, r_i, m_i, i_k, H, HV, K, BKS, B_HEAD)
    return (tl.load(gc + r_s * (HV * K) + cols, mask=m_c, other=0.),
            load_tile(gc, rows, jm, cols, m_c, HV * K, gc.dtype.element_ty),
            load_tile(k, rows, jm, cols, m_c, H * K, k.dtype.element_ty),
            load_tile(gc, r_i, m_i, cols, m_c, HV * K, gc.dtype.element_ty),
            r_q, r_k, r_b, direction_source(z, d_in, r_i, m_i, cols, m_c, HV, K, DIR_SOURCE))


@triton.jit
def _diag_exact(k, gc, rk, b_q, b_a, b_d, G_i, m_i, r_s, eos, cols, cq, ck, cd, off,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, PROBES: tl.constexpr, BC: tl.constexpr,
                BT: tl.constexpr, DT: tl.constexpr):
    """Columns ``off .. off+BC-1`` (the diagonal block) from exact per-element exponentials;
    key row ``j`` and its ``G`` are read from memory."""
    r = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    for j in range(BC):
        m_j = cols < K * (r_s + j < eos).to(tl.int32)  # a tensor mask (tensor & scalar is refused)
        kj = tl.load(k + (r_s + j) * (H * K) + cols, mask=m_j, other=0.).to(DT)
        kj *= tl.load(rk + (r_s + j) * HV, mask=r_s + j < eos, other=0.).to(DT)
        gj = tl.load(gc + (r_s + j) * (HV * K) + cols, mask=m_j, other=0.).to(DT)
        ke = exp(tl.where((r[:, None] >= j) & m_i[:, None], G_i - gj[None, :], 0.)) * kj[None, :]
        sel = o_t[None, :] == off + j
        cq = tl.where(sel, tl.sum(b_q * ke, 1)[:, None], cq)
        ck = tl.where(sel, tl.sum(b_a * ke, 1)[:, None], ck)
        if PROBES:
            cd = tl.where(sel, tl.sum(b_d * ke, 1)[:, None], cd)
    return cq, ck, cd


SCORES_SWITCHES = {
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
    "PROBES": lambda args: args["adk"] is not None,
    "LAM_TOKEN": lambda args: args["lam"].dim() == 3,
    "B_HEAD": lambda args: args["b"].dim() == 3,
}
"""Compile-time switches of the score kernel, from its arguments: packed rows, probes, per-token
lambda, per-head erase gate."""


@triton.heuristics(SCORES_SWITCHES)
@triton.jit(do_not_specialize=["T"])
def qed_scores_kernel(
    q, k, b, lam, z, d_in, gc, rq, rk, cp,
    aqk, akk, adk,
    cu_seqlens, chunk_indices, T, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr, SPAN: tl.constexpr, LAM_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr,
    PROBES: tl.constexpr, B_HEAD: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    """Row block ``i_i`` (``BC`` tokens) of one chunk's ``A_qk, A_kk, A_dk``, grid ``(B * HV,
    chunks x BT // BC)`` heads first (``(chunks x BT // BC, B * HV)`` past the axis limit) with the
    row blocks of a chunk next to each other on the chunk axis: they read the same key rows, which
    the later blocks then find in L2."""
    NB: tl.constexpr = BT // BC
    i_x, i_bh = chunk_axes(HEADS_FIRST)
    i_hv, i_t, _i_g, bos, eos = chunk_at(i_x // NB, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    i_i = i_x % NB
    c0 = bos + i_t * BT
    r_s = c0 + i_i * BC                          # reference row: the block's first
    if r_s >= eos:
        return
    q, k, b, lam = head_pointers(q, k, b, lam, i_hv, H, HV, K, B_HEAD)
    if z is not None:
        z += i_hv * K
    if d_in is not None:
        d_in += i_hv * K
    gc += i_hv * K
    rq += i_hv
    rk += i_hv
    cp += i_hv

    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    rows = c0 + o_t
    jm = (o_t < (i_i + 1) * BC) & (rows < eos)   # key rows this block reads
    r_e = tl.minimum(r_s + BC - 1, eos - 1)     # last valid row of the block
    r_i = r_s + o_c
    m_i = r_i < eos
    rq_i, rk_i, c_i, l_i = row_scalars(rq, rk, cp, lam, r_i, m_i, HV, LAM_TOKEN, DT)
    rk_f = tl.load(rk + rows * HV, mask=jm, other=0.).to(DT)
    NK: tl.constexpr = (K + BKS - 1) // BKS
    # slice 0's loads first: in flight during the span pass
    p_gs, p_Gf, p_kf, p_Gi, p_q, p_k, p_b, p_x = _score_slice(q, k, b, z, d_in, gc, rows, jm, r_i, m_i, r_s, 0,
                                                              H, HV, K, BKS, DIR_SOURCE, B_HEAD)
    # the block's decay span, max over all K (one reduction); each iteration first issues the
    # next slice's loads
    span = tl.zeros([BKS], dtype=DT)
    p_s, p_e = _span_rows(gc, r_s, r_e, 0, HV, K, BKS)
    for i_k in range(NK):
        n_s, n_e = _span_rows(gc, r_s, r_e, i_k + 1, HV, K, BKS)
        span = tl.maximum(span, p_s.to(DT) - p_e.to(DT))
        p_s, p_e = n_s, n_e
    exact = tl.max(span, 0) > SPAN
    accq = tl.zeros([BC, BT], dtype=DT)
    acck = tl.zeros([BC, BT], dtype=DT)
    accd = tl.zeros([BC, BT], dtype=DT)
    # the score products per key slice; each iteration first issues the next slice's loads
    for i_k in range(NK):
        cols, m_c = channel_slice(i_k, BKS, K)
        n_gs, n_Gf, n_kf, n_Gi, n_q, n_k, n_b, n_x = _score_slice(q, k, b, z, d_in, gc, rows, jm, r_i, m_i, r_s,
                                                                  i_k + 1, H, HV, K, BKS, DIR_SOURCE, B_HEAD)
        gs = p_gs.to(DT)
        G_f = p_Gf.to(DT)
        k_f = p_kf.to(DT) * rk_f[:, None]
        G_i = p_Gi.to(DT)
        b_q, _k, b_a, b_d = erase_from(p_q.to(DT), p_k.to(DT), p_b.to(DT), p_x, rq_i, rk_i, c_i, l_i, DIR_SOURCE,
                                       DIR_GATED, DT)
        e1 = tl.where(m_i[:, None], exp(G_i - gs[None, :]), 0.)
        kr = tl.trans(tl.where(jm[:, None], k_f * exp(tl.minimum(gs[None, :] - G_f, 80.)), 0.))
        cq = tl.dot(b_q * e1, kr, input_precision=PREC)
        ck = tl.dot(b_a * e1, kr, input_precision=PREC)
        if PROBES:
            cd = tl.dot(b_d * e1, kr, input_precision=PREC)
        else:
            cd = ck
        if exact:
            cq, ck, cd = _diag_exact(k, gc, rk, b_q, b_a, b_d, G_i, m_i, r_s, eos, cols, cq, ck, cd,
                                     i_i * BC, H, HV, K, PROBES, BC, BT, DT)
        accq += cq
        acck += ck
        if PROBES:
            accd += cd
        p_gs, p_Gf, p_kf, p_Gi, p_q, p_k, p_b, p_x = n_gs, n_Gf, n_kf, n_Gi, n_q, n_k, n_b, n_x
    ri = (i_i * BC + o_c)[:, None]
    mc = o_t < (i_i + 1) * BC                   # the column blocks on and below the diagonal
    off = i_hv * BT
    store_tile(aqk + off, tl.where(ri >= o_t[None, :], accq, 0.) * scale, r_i, m_i, o_t, mc, HV * BT)
    store_tile(akk + off, tl.where(ri > o_t[None, :], acck, 0.), r_i, m_i, o_t, mc, HV * BT)
    if PROBES:
        store_tile(adk + off, tl.where(ri > o_t[None, :], accd, 0.), r_i, m_i, o_t, mc, HV * BT)


@dataclass(frozen=True)
class Scores:
    """The chunk-local score matrices, ``[B, T, HV, BT]`` (row ``t`` holds its chunk's row):
    ``aqk`` (causal incl. diagonal, scaled; intermediate dtype), ``akk`` (strictly causal; state
    dtype) and, with probes, ``adk`` (strictly causal; intermediate dtype), else ``None``. Only
    the ``BC``-column blocks on and below the diagonal are written (zeros above the diagonal
    inside them); the blocks above are left as allocated, and every reader masks its loads to
    the causal part."""

    aqk: torch.Tensor
    akk: torch.Tensor
    adk: torch.Tensor | None


def chunk_scores_fwd(x: DirectionInputs, prep: Prepared, *, scale: float, lay: ChunkLayout,
                     inter_dtype: torch.dtype, probes: bool) -> Scores:
    """Launch ``qed_scores_kernel`` (grid: value heads x (chunks x ``BT // BC`` row blocks),
    :func:`~.chunk_common.heads_first`)."""
    B, T, HV, K = prep.gc.shape
    dev = prep.gc.device
    out = Scores(aqk=torch.empty(B, T, HV, BT, device=dev, dtype=inter_dtype),
                 akk=torch.empty(B, T, HV, BT, device=dev, dtype=lay.state_dtype),
                 adk=torch.empty(B, T, HV, BT, device=dev, dtype=inter_dtype) if probes else None)
    grid, first = heads_first(lay.grid, BT // BC)
    qed_scores_kernel[grid](
        q=x.q, k=x.k, b=x.b, lam=x.lam, z=x.z, d_in=x.d, gc=prep.gc, rq=prep.rq, rk=prep.rk, cp=prep.cp,
        aqk=out.aqk, akk=out.akk, adk=out.adk,
        cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T, scale=scale,
        H=x.q.shape[2], HV=HV, K=K, BT=BT, BC=BC, BKS=min(SCORES_BKS, triton.next_power_of_2(K)),
        DIR_SOURCE=x.flags["DIR_SOURCE"], DIR_GATED=x.flags["DIR_GATED"], DT=lay.DT, PREC=lay.prec,
        SPAN=SPAN_MAX, HEADS_FIRST=first, num_warps=SCORES_WARPS, num_stages=1,
    )
    return out
