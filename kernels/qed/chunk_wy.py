r"""Intra-chunk kernels of ``qed_chunk``, part 2: the UT-transform inverse and the WY factors
(see ``chunk.py`` for the algorithm, ``chunk_intra.py`` for what they read).

``qed_inverse_kernel`` (one program per chunk and value head): ``Ai = (I + A_kk)^{-1}`` for the
strictly lower ``[BT, BT]`` chunk matrix ``A_kk``, in blocks of ``BC = 16`` rows: the four
diagonal blocks at once by forward substitution on a ``[4, 16, 16]`` tile (row ``i`` =
``e_i - sum_{m<i} A[i, m] row m``, the rows of ``A`` loaded from memory: 15 dependent steps),
then the off-diagonal blocks by block products ``Ai_IJ = -Ai_II sum_{J<=M<I} A_IM Ai_MJ`` at the
forward's ``tl.dot`` precision (tf32 for bf16 inputs, as fla's solve; tf32x3 for float32, ieee
for float64).
It reads only the blocks of ``A_kk`` on and below the diagonal and writes every block of ``Ai``,
zeros above the diagonal, so that readers load its rows whole (a load masked to the lower
triangle is compiled to one scalar load per element, and selecting it in registers costs the
W/U kernel a quarter of its programs per SM).
The unrolling is written for ``BT = 4 * BC`` (checked on the host).

``qed_wy_kernel`` (one program per chunk and value head), as fla's ``wy_fast.py``:
``W = Ai (a e^G)`` (``[BT, K]``) and ``U = Ai (w v)`` (``[BT, V]``, the write gate ``w`` per
channel or one scalar per row), with ``a e^G`` as the prep kernel wrote it (in the products' dtype, as fla casts ``b k e^G`` before its product).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .chunk_common import (BC, BT, ChunkLayout, channel_slice, chunk_position, exp, gate_head,
                           gate_tile, heads_first, load_tile, row_factors, store_tile)

WY_BKS = 32
"""Key slice of the W/U kernel."""
WY_BVS = 32
"""Value slice of the W/U kernel."""
WY_HEAD_SLICE = 64
"""Key and value slices of the W/U kernel for a per-head write gate (``[B, T, HV]``: one scalar
per row): ``[64, 64]`` tiles, faster there than 32 on an H100 (docs/BENCHMARKS.md)."""
SCALAR_WY_SLICE = 128
"""Key and value slices of the scalar-gate W/U kernel: ``[64, 128]`` tiles (the whole axis at
K = V = 128), faster on an H100 than 64 at 1 x 32K tokens and equal at 8 x 4K (docs/BENCHMARKS.md)."""
WY_WARPS = 4
INVERSE_WARPS = 1
"""Warps of the two kernels, by rule (no autotuning). The inverse runs in one warp: its forward
substitution is a chain of 15 dependent row reductions, which inside one warp need no barrier
and leave room for many programs per SM (docs/BENCHMARKS.md has the screen)."""


@triton.jit
def _inv_diag(akk, c0, eos, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr):
    """``(I + A_JJ)^{-1}`` of the ``BT // BC`` diagonal blocks of the strictly lower ``A_kk`` as one
    ``[BT // BC, BC, BC]`` tile, by forward substitution over the block rows."""
    o_b = tl.arange(0, BT // BC)
    o_c = tl.arange(0, BC)
    eye = tl.where(o_c[:, None] == o_c[None, :], 1., 0.).to(DT)
    X = tl.zeros([BT // BC, BC, BC], dtype=DT) + eye[None, :, :]
    for i in tl.static_range(1, BC):
        r = c0 + o_b * BC + i
        a = tl.load(akk + r[:, None] * (HV * BT) + (o_b * BC)[:, None] + o_c[None, :],
                    mask=(r < eos)[:, None] & (o_c < i)[None, :], other=0.).to(DT)
        X = tl.where((o_c == i)[None, :, None], X - tl.sum(a[:, :, None] * X, 1)[:, None, :], X)
    return X


@triton.jit
def _block_of(X, J: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Block ``J`` (``[BC, BC]``) of a ``[BT // BC, BC, BC]`` tile."""
    o_b = tl.arange(0, BT // BC)
    return tl.sum(tl.where((o_b == J)[:, None, None], X, 0.), 0)


@triton.jit
def _blk(A, r0, eos, I: tl.constexpr, J: tl.constexpr, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
         DT: tl.constexpr):
    """Block ``(I, J)`` (``BC x BC``) of a ``[BT, BT]`` per-chunk matrix starting at row ``r0``."""
    rows = r0 + I * BC + tl.arange(0, BC)
    cols = J * BC + tl.arange(0, BC)
    return load_tile(A, rows, rows < eos, cols, cols < BT, HV * BT, DT)


@triton.jit
def _set(A, x, r0, eos, I: tl.constexpr, J: tl.constexpr, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Store ``x`` as block ``(I, J)`` of a ``[BT, BT]`` per-chunk matrix starting at row ``r0``."""
    rows = r0 + I * BC + tl.arange(0, BC)
    cols = J * BC + tl.arange(0, BC)
    store_tile(A, x, rows, rows < eos, cols, cols < BT, HV * BT)


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    """``a @ b`` of two ``[BC, BC]`` blocks at ``tl.dot`` precision ``PREC``."""
    return tl.dot(a, b, input_precision=PREC)


@triton.heuristics({"IS_VARLEN": lambda args: args["cu_seqlens"] is not None})
@triton.jit(do_not_specialize=["T"])
def qed_inverse_kernel(
    akk, ai, cu_seqlens, chunk_indices, T,
    HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    i_hv, i_t, _i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN, HEADS_FIRST)
    c0 = bos + i_t * BT
    akk += i_hv * BT
    ai += i_hv * BT
    X = _inv_diag(akk, c0, eos, HV, BT, BC, DT)
    i00 = _block_of(X, 0, BT, BC)
    i11 = _block_of(X, 1, BT, BC)
    i22 = _block_of(X, 2, BT, BC)
    i33 = _block_of(X, 3, BT, BC)
    k10 = _blk(akk, c0, eos, 1, 0, HV, BT, BC, DT)
    k20 = _blk(akk, c0, eos, 2, 0, HV, BT, BC, DT)
    k21 = _blk(akk, c0, eos, 2, 1, HV, BT, BC, DT)
    k30 = _blk(akk, c0, eos, 3, 0, HV, BT, BC, DT)
    k31 = _blk(akk, c0, eos, 3, 1, HV, BT, BC, DT)
    k32 = _blk(akk, c0, eos, 3, 2, HV, BT, BC, DT)
    i10 = -_mm(i11, _mm(k10, i00, PREC), PREC)
    i21 = -_mm(i22, _mm(k21, i11, PREC), PREC)
    i32 = -_mm(i33, _mm(k32, i22, PREC), PREC)
    i20 = -_mm(i22, _mm(k20, i00, PREC) + _mm(k21, i10, PREC), PREC)
    i31 = -_mm(i33, _mm(k31, i11, PREC) + _mm(k32, i21, PREC), PREC)
    i30 = -_mm(i33, _mm(k30, i00, PREC) + _mm(k31, i10, PREC) + _mm(k32, i20, PREC), PREC)
    _set(ai, i00, c0, eos, 0, 0, HV, BT, BC)
    _set(ai, i10, c0, eos, 1, 0, HV, BT, BC)
    _set(ai, i11, c0, eos, 1, 1, HV, BT, BC)
    _set(ai, i20, c0, eos, 2, 0, HV, BT, BC)
    _set(ai, i21, c0, eos, 2, 1, HV, BT, BC)
    _set(ai, i22, c0, eos, 2, 2, HV, BT, BC)
    _set(ai, i30, c0, eos, 3, 0, HV, BT, BC)
    _set(ai, i31, c0, eos, 3, 1, HV, BT, BC)
    _set(ai, i32, c0, eos, 3, 2, HV, BT, BC)
    _set(ai, i33, c0, eos, 3, 3, HV, BT, BC)
    zero = tl.zeros([BC, BC], dtype=DT)
    for I in tl.static_range(BT // BC):
        for J in tl.static_range(I + 1, BT // BC):
            _set(ai, zero, c0, eos, I, J, HV, BT, BC)


def chunk_inverse_fwd(akk: torch.Tensor, *, lay: ChunkLayout, out_dtype: torch.dtype) -> torch.Tensor:
    """``(I + A_kk)^{-1}`` per chunk, ``[B, T, HV, BT]`` (``qed_inverse_kernel``, grid: value heads x
    chunks, :func:`~.chunk_common.heads_first`): computed in the state dtype, stored in
    ``out_dtype`` (bf16 for bf16 inputs, as fla stores its inverse), zero above the diagonal."""
    B, T, HV, bt = akk.shape
    if bt != BT or BT != 4 * BC:
        raise ValueError(f"qed_inverse_kernel unrolls a chunk of BT = 4 x BC = {4 * BC} rows, "
                         f"got BT={bt} (BC={BC})")
    ai = torch.empty_like(akk, dtype=out_dtype)
    grid, first = heads_first(lay.grid)
    qed_inverse_kernel[grid](
        akk=akk, ai=ai, cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T,
        HV=HV, BT=BT, BC=BC, DT=lay.DT, PREC=lay.prec, HEADS_FIRST=first, num_warps=INVERSE_WARPS, num_stages=1,
    )
    return ai


@triton.heuristics({
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
    "W_HEAD": lambda args: args["w_gate"].dim() == 3,
})
@triton.jit(do_not_specialize=["T"])
def qed_wy_kernel(
    ag, v, w_gate, ai, w, u,
    cu_seqlens, chunk_indices, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr,
    BVS: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr, W_HEAD: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
):
    i_hv, i_t, _i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN, HEADS_FIRST)
    o_t = tl.arange(0, BT)
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    b_ai = _inverse_tile(ai, rows, m_t, i_hv, HV, BT).to(ag.dtype.element_ty)

    off = i_hv * K
    for i_k in range(tl.cdiv(K, BKS)):
        cols, m_c = channel_slice(i_k, BKS, K)
        b_ag = tl.load(ag + off + rows[:, None] * (HV * K) + cols[None, :], mask=m_t[:, None] & m_c[None, :], other=0.)
        store_tile(w + off, tl.dot(b_ai, b_ag, input_precision=PREC), rows, m_t, cols, m_c, HV * K)
    _store_u(v, w_gate, b_ai, u, rows, m_t, i_hv, HV, V, BVS, DT, PREC, W_HEAD)


@triton.jit
def _inverse_tile(ai, rows, m_t, i_hv, HV: tl.constexpr, BT: tl.constexpr):
    """The chunk's ``(I + A_kk)^{-1}`` of value head ``i_hv`` (rows ``rows``; zero above the
    diagonal as the inverse kernel writes it), its rows loaded whole."""
    o_t = tl.arange(0, BT)
    return load_tile(ai + i_hv * BT, rows, m_t, o_t, o_t < BT, HV * BT, ai.dtype.element_ty)


@triton.jit
def _store_u(v, w_gate, b_ai, u, rows, m_t, i_hv, HV: tl.constexpr, V: tl.constexpr, BVS: tl.constexpr,
             DT: tl.constexpr, PREC: tl.constexpr, W_HEAD: tl.constexpr):
    """``U = Ai (w v)`` of one chunk and value head, in value slices of ``BVS`` (the products in
    ``b_ai``'s dtype)."""
    off = i_hv * V
    w_gate = gate_head(w_gate, i_hv, V, W_HEAD)
    for i_v in range(tl.cdiv(V, BVS)):
        cols, m_c = channel_slice(i_v, BVS, V)
        b_wv = load_tile(v + off, rows, m_t, cols, m_c, HV * V, DT) * gate_tile(w_gate, rows, m_t, cols, m_c, HV, V,
                                                                                 W_HEAD, DT)
        store_tile(u + off, tl.dot(b_ai, b_wv.to(b_ai.dtype), input_precision=PREC), rows, m_t, cols, m_c, HV * V)


@dataclass(frozen=True)
class WYFactors:
    """``w = Ai (a e^G)`` ``[B, T, HV, K]`` and ``u = Ai (w_gate v)`` ``[B, T, HV, V]``."""

    w: torch.Tensor
    u: torch.Tensor


def chunk_wy_fwd(ag: torch.Tensor, v: torch.Tensor, w_gate: torch.Tensor, ai: torch.Tensor, *,
                 lay: ChunkLayout) -> WYFactors:
    """Launch ``qed_wy_kernel`` (grid: value heads x chunks, :func:`~.chunk_common.heads_first`) on
    ``ag = a e^G`` (its dtype is that of the products and of ``W, U``), the values and write gate,
    and ``Ai``."""
    B, T, HV, K = ag.shape
    V = v.shape[-1]
    out = WYFactors(w=torch.empty_like(ag), u=torch.empty(B, T, HV, V, device=v.device, dtype=ag.dtype))
    head_w = w_gate.dim() == 3
    grid, first = heads_first(lay.grid)
    qed_wy_kernel[grid](
        ag=ag, v=v, w_gate=w_gate, ai=ai, w=out.w, u=out.u,
        cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T,
        HV=HV, K=K, V=V, BT=BT, BKS=min(WY_HEAD_SLICE if head_w else WY_BKS, triton.next_power_of_2(K)),
        BVS=min(WY_HEAD_SLICE if head_w else WY_BVS, triton.next_power_of_2(V)), DT=lay.DT, PREC=lay.prec,
        HEADS_FIRST=first, num_warps=WY_WARPS, num_stages=1,
    )
    return out


@triton.heuristics({
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
    "W_HEAD": lambda args: args["w_gate"].dim() == 3,
})
@triton.jit(do_not_specialize=["T"])
def qed_scalar_wy_kernel(
    q, k, rk, z, d_in, gc, alpha, gamma, v, w_gate, ai, w, u,
    cu_seqlens, chunk_indices, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr,
    BVS: tl.constexpr, DIR_SOURCE: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
    W_HEAD: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    i_hv, i_t, _i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN, HEADS_FIRST)
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    b_ai = _inverse_tile(ai, rows, m_t, i_hv, HV, BT)
    if rk is not None:  # W, U with the raw keys' reciprocal norms on their rows (the scan's residuals then)
        b_ai *= row_factors(rk, rows, m_t, H, i_h, DT)[:, None]
    b_ai = b_ai.to(w.dtype.element_ty)
    p = rows * HV + i_hv
    ex = exp(tl.load(gc + p, mask=m_t, other=0.).to(DT))
    b_al = tl.load(alpha + p, mask=m_t, other=0.).to(DT) * ex
    b_ga = tl.load(gamma + p, mask=m_t, other=0.).to(DT) * ex
    for i_k in range(tl.cdiv(K, BKS)):
        cols, m_c = channel_slice(i_k, BKS, K)
        b_ag = b_al[:, None] * load_tile(k + i_h * K, rows, m_t, cols, m_c, H * K, DT)
        if DIR_SOURCE == "q":
            b_ag += b_ga[:, None] * load_tile(q + i_h * K, rows, m_t, cols, m_c, H * K, DT)
        elif DIR_SOURCE == "z":
            b_ag += b_ga[:, None] * tl.load(z + i_hv * K + cols, mask=m_c, other=0.).to(DT)[None, :]
        elif DIR_SOURCE == "d":
            b_ag += b_ga[:, None] * load_tile(d_in + i_hv * K, rows, m_t, cols, m_c, HV * K, DT)
        store_tile(w + i_hv * K, tl.dot(b_ai, b_ag.to(b_ai.dtype), input_precision=PREC), rows, m_t, cols, m_c,
                   HV * K)
    _store_u(v, w_gate, b_ai, u, rows, m_t, i_hv, HV, V, BVS, DT, PREC, W_HEAD)


def scalar_wy_fwd(x, gram, v: torch.Tensor, w_gate: torch.Tensor, ai: torch.Tensor, *, lay: ChunkLayout,
                  config: tuple[int, int, int] | None = None) -> WYFactors:
    """Launch ``qed_scalar_wy_kernel`` (grid: value heads x chunks,
    :func:`~.chunk_common.heads_first`): ``W = Ai (a e^G)`` with the erase vector ``a = alpha
    k_hat + gamma x`` built from the raw keys and queries in ``x`` (``chunk_intra.DirectionInputs``)
    and the Gram stage's per-row ``alpha, gamma`` (which hold the reciprocal norms: ``alpha k_hat =
    (alpha r_k) k``), ``G`` and the arm's direction source, and ``U = Ai (w v)``; ``W, U`` in
    ``ai``'s dtype. Where the Gram stage stored the keys' reciprocal norms ``r_k`` rather than
    ``k_hat`` (``gram.rk``), both come out with ``r_k`` on their rows, so that the scan's residuals
    ``r_k (U - W S)`` pair with the raw keys: ``K^T (r_k R) = K_hat^T R``.
    ``config`` ``(slice, num_warps, num_stages)`` overrides the rule (for screening)."""
    B, T, H, K = x.k.shape
    bs, num_warps, num_stages = config or (SCALAR_WY_SLICE, WY_WARPS, 1)
    HV, V = v.shape[2], v.shape[-1]
    out = WYFactors(w=torch.empty(B, T, HV, K, device=v.device, dtype=ai.dtype),
                    u=torch.empty(B, T, HV, V, device=v.device, dtype=ai.dtype))
    grid, first = heads_first(lay.grid)
    qed_scalar_wy_kernel[grid](
        q=x.q, k=x.k, rk=gram.rk, z=x.z, d_in=x.d, gc=gram.gc, alpha=gram.alpha, gamma=gram.gamma,
        v=v, w_gate=w_gate, ai=ai, w=out.w, u=out.u,
        cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T,
        H=H, HV=HV, K=K, V=V, BT=BT, BKS=min(bs, triton.next_power_of_2(K)),
        BVS=min(bs, triton.next_power_of_2(V)), DIR_SOURCE=x.flags["DIR_SOURCE"], DT=lay.DT,
        PREC=lay.prec, HEADS_FIRST=first, num_warps=num_warps, num_stages=num_stages,
    )
    return out
