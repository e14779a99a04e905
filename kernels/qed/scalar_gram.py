r"""Scalar-gate path of ``qed_chunk``, stage 1: normalised keys and queries and their Gram matrices
once per query/key head; per value head the erase scores and their inverse ``(I + A_kk)^{-1}``.

With a per-head decay ``g`` and a per-head erase gate ``b`` (``[B, T, HV]``: Gated DeltaNet's
``g`` and ``beta``) the erase vector of every arm is a per-row combination of two vectors::

    a_t = alpha_t k_hat_t + gamma_t x_t,    d_t = bx_t x_t - c_t k_hat_t

with ``x`` the arm's raw direction (``q_hat``; ``z`` of the value head for ``rand``; a given
``d``; none for ``gdn2``), ``bx = b`` for the gated arms (else 1), ``c = bx (k_hat . x)`` for the
projected arms (else 0), ``alpha = b - lam c`` and ``gamma = lam bx`` (0 without a direction).
So the chunk's erase scores are two Gram matrices of the query/key head, weighted per row and
multiplied by the value head's decay matrix (``G`` the within-chunk cumsum of ``g``)::

    A_kk[t, j] = (alpha_t (k_hat_t . k_hat_j) + gamma_t (x_t . k_hat_j)) e^{G_t - G_j}   (j < t)

and the erase eigenvalue is ``e_t = 1 - alpha_t |k_hat_t|^2 - gamma_t (x_t . k_hat_t)``.

``qed_scalar_gram_kernel`` (one program per chunk and query/key head): loads the raw ``q, k`` of
the chunk once, in four 16-row blocks, normalises them (stored in the products' dtype for the
later stages, as fla's ``l2norm`` kernel) and forms the ten blocks on and below the diagonal of
``K K^T`` and ``Q K^T`` once; then for each of the ``HV / H`` value heads of its group: ``G``
(the decay's cumsum), ``alpha, gamma`` (stored per row for the W/U and output stages), the blocks
of ``A_kk`` and, in registers, ``Ai = (I + A_kk)^{-1}`` (forward substitution on the diagonal
blocks, then the block products of ``chunk_wy``, as fla's fused ``kkt_solve``), stored in the
products' dtype; with probes ``rho, e, d`` and ``c``. Each exponent ``G_t - G_j`` (``j <= t``) is
``<= 0`` for any ``g <= 0``; the pairs above the diagonal are zeroed before the exponential.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .chunk_common import BC, BT, ChunkLayout, chunk_position, exp, load_tile, store_tile
from .chunk_intra import DirectionInputs
from .chunk_wy import diagonal_inverse, merge_blocks, store_inverse


@dataclass(frozen=True)
class ScalarGram:
    """What the Gram stage writes: ``qn, kn`` ``[B, T, H, K]`` (normalised, products' dtype);
    per row and value head ``[B, T, HV]`` (state dtype) ``gc`` (``G``), ``alpha, gamma``; ``ai``
    ``= (I + A_kk)^{-1}`` ``[B, T, HV, BT]`` (products' dtype; only the blocks on and below the
    diagonal are written). Probes (else ``None``): ``rho, e, c`` ``[B, T, HV]`` and
    ``d`` ``[B, T, HV, K]`` in the state dtype."""

    qn: torch.Tensor
    kn: torch.Tensor
    gc: torch.Tensor
    alpha: torch.Tensor
    gamma: torch.Tensor
    ai: torch.Tensor
    rho: torch.Tensor | None
    e: torch.Tensor | None
    c: torch.Tensor | None
    d: torch.Tensor | None


@triton.jit
def _qk_block(q, k, qn, kn, rows, m_r, o_k, m_k, H: tl.constexpr, K: tl.constexpr, L2NORM: tl.constexpr,
              DT: tl.constexpr):
    """One 16-row block of the raw ``q, k`` of a query/key head (pointers moved to it), normalised
    and stored to ``qn, kn``: ``(q_hat, k_hat)`` in the products' dtype, and ``|k_hat|^2``,
    ``q_hat . k_hat`` per row from the unrounded values."""
    b_q = load_tile(q, rows, m_r, o_k, m_k, H * K, DT)
    b_k = load_tile(k, rows, m_r, o_k, m_k, H * K, DT)
    if L2NORM:
        b_q = b_q * (1. / tl.sqrt(tl.sum(b_q * b_q, 1) + 1e-6))[:, None]
        b_k = b_k * (1. / tl.sqrt(tl.sum(b_k * b_k, 1) + 1e-6))[:, None]
    store_tile(qn, b_q, rows, m_r, o_k, m_k, H * K)
    store_tile(kn, b_k, rows, m_r, o_k, m_k, H * K)
    return b_q.to(qn.dtype.element_ty), b_k.to(kn.dtype.element_ty), tl.sum(b_k * b_k, 1), tl.sum(b_q * b_k, 1)


@triton.jit
def _gram(a, b, PREC: tl.constexpr):
    """``a b^T`` of two ``[16, K]`` row blocks, float32 (float64) accumulation."""
    return tl.dot(a, tl.trans(b), input_precision=PREC)


@triton.jit
def _direction(z, d_in, c_q, c_k, qk, rows, m_r, o_k, m_k, i_hv, HV: tl.constexpr, K: tl.constexpr,
               DIR_SOURCE: tl.constexpr, DT: tl.constexpr):
    """One row block's raw direction for value head ``i_hv``: ``(x, xk)`` = the tile (a given
    ``d`` in the products' dtype, ``q_hat``, ``z`` broadcast, or zeros) and ``x . k_hat`` per row
    (``q_hat . k_hat`` for a direction from ``q``; for ``z`` also the columns' ``z . k_hat_j``)."""
    if DIR_SOURCE == "z":
        zz = tl.load(z + i_hv * K + o_k, mask=m_k, other=0.).to(DT)
        x = c_k.to(DT) * 0. + zz[None, :]
        xk = tl.sum(c_k.to(DT) * zz[None, :], 1)
    elif DIR_SOURCE == "d":
        x = load_tile(d_in + i_hv * K, rows, m_r, o_k, m_k, HV * K, DT).to(c_k.dtype)
        xk = tl.sum(x.to(DT) * c_k.to(DT), 1)
    elif DIR_SOURCE == "q":
        x = c_q
        xk = qk
    else:
        x = c_k * 0.
        xk = qk * 0.
    return x, xk


@triton.jit
def _xk(QK, x_i, c_kj, xk_j, DIR_SOURCE: tl.constexpr, PREC: tl.constexpr):
    """Block ``(I, J)`` of ``X K^T``: the query/key head's ``Q K^T`` block, a row of ``z . k_hat_j``,
    the given ``d``'s own product, or zeros."""
    if DIR_SOURCE == "q":
        out = QK
    elif DIR_SOURCE == "z":
        out = QK * 0. + xk_j[None, :]
    elif DIR_SOURCE == "d":
        out = _gram(x_i, c_kj, PREC)
    else:
        out = QK * 0.
    return out


@triton.jit
def _row_gates(g, b, lam, rows, m_r, G_in, xk, i_hv, HV: tl.constexpr, LAM_TOKEN: tl.constexpr,
               DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr, DIR_PROJECTED: tl.constexpr, DT: tl.constexpr):
    """One row block's per-row values for value head ``i_hv``: ``(G, alpha, gamma, bx, c)``, with
    ``G`` the chunk's cumsum of ``g`` continued from ``G_in`` (the previous block's last row)."""
    p = rows * HV + i_hv
    G = G_in + tl.cumsum(tl.load(g + p, mask=m_r, other=0.).to(DT), 0)
    b_b = tl.load(b + p, mask=m_r, other=0.).to(DT)
    if LAM_TOKEN:
        b_l = tl.load(lam + p, mask=m_r, other=0.).to(DT)
    else:
        b_l = b_b * 0. + tl.load(lam + i_hv).to(DT)
    bx = b_b if DIR_GATED else b_b * 0. + 1.
    c = bx * xk if DIR_PROJECTED else xk * 0.
    gamma = b_l * bx if DIR_SOURCE != "none" else b_l * 0.
    return G, b_b - b_l * c, gamma, bx, c


@triton.jit
def _last_row(G, BC: tl.constexpr):
    """The last element of a ``[BC]`` row vector (the cumsum at a block's last row)."""
    return tl.sum(tl.where(tl.arange(0, BC) == BC - 1, G, 0.), 0)


@triton.jit
def _a_block(KK, XK, al_i, ga_i, G_i, G_j, DIAG: tl.constexpr, BC: tl.constexpr):
    """Block ``(I, J)`` of ``A_kk``: ``(alpha_t KK + gamma_t XK) e^{G_t - G_j}``, strictly below the
    diagonal on a diagonal block (``DIAG``; the exponent zeroed above it first)."""
    e = G_i[:, None] - G_j[None, :]
    if DIAG:
        o_c = tl.arange(0, BC)
        strict = o_c[:, None] > o_c[None, :]
        out = tl.where(strict, (al_i[:, None] * KK + ga_i[:, None] * XK) * exp(tl.where(strict, e, 0.)), 0.)
    else:
        out = (al_i[:, None] * KK + ga_i[:, None] * XK) * exp(e)
    return out


@triton.jit
def _store_rows(gc, alpha, gamma, rho, eig, cp, d_out, rows, m_r, o_k, m_k, i_hv, G, al, ga, bx, c, kk, qk, xk, x,
                c_k, HV: tl.constexpr, K: tl.constexpr, DT: tl.constexpr, PROBES: tl.constexpr):
    """Store one row block's ``G, alpha, gamma`` for value head ``i_hv`` and, with probes, its
    ``rho, e, c`` and ``d = bx x - c k_hat``."""
    p = rows * HV + i_hv
    tl.store(gc + p, G.to(gc.dtype.element_ty), mask=m_r)
    tl.store(alpha + p, al.to(alpha.dtype.element_ty), mask=m_r)
    tl.store(gamma + p, ga.to(gamma.dtype.element_ty), mask=m_r)
    if PROBES:
        tl.store(rho + p, qk.to(rho.dtype.element_ty), mask=m_r)
        tl.store(eig + p, (1. - al * kk - ga * xk).to(eig.dtype.element_ty), mask=m_r)
        tl.store(cp + p, c.to(cp.dtype.element_ty), mask=m_r)
        store_tile(d_out + i_hv * K, bx[:, None] * x.to(DT) - c[:, None] * c_k.to(DT), rows, m_r, o_k, m_k, HV * K)


@triton.heuristics({
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
    "PROBES": lambda args: args["rho"] is not None,
    "LAM_TOKEN": lambda args: args["lam"].dim() == 3,
})
@triton.jit(do_not_specialize=["T"])
def qed_scalar_gram_kernel(
    q, k, g, b, lam, z, d_in,
    qn, kn, gc, alpha, gamma, ai, rho, eig, cp, d_out,
    cu_seqlens, chunk_indices, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    L2NORM: tl.constexpr, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr, DIR_PROJECTED: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, LAM_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr, PROBES: tl.constexpr,
):
    i_h, i_t, _i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    c0 = bos + i_t * BT
    r0 = c0 + tl.arange(0, BC)
    r1 = r0 + BC
    r2 = r1 + BC
    r3 = r2 + BC
    m0, m1, m2, m3 = r0 < eos, r1 < eos, r2 < eos, r3 < eos
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    q += i_h * K
    k += i_h * K
    qn += i_h * K
    kn += i_h * K
    cq0, ck0, kk0, qk0 = _qk_block(q, k, qn, kn, r0, m0, o_k, m_k, H, K, L2NORM, DT)
    cq1, ck1, kk1, qk1 = _qk_block(q, k, qn, kn, r1, m1, o_k, m_k, H, K, L2NORM, DT)
    cq2, ck2, kk2, qk2 = _qk_block(q, k, qn, kn, r2, m2, o_k, m_k, H, K, L2NORM, DT)
    cq3, ck3, kk3, qk3 = _qk_block(q, k, qn, kn, r3, m3, o_k, m_k, H, K, L2NORM, DT)
    # the ten blocks on and below the diagonal of K K^T and (direction from q) Q K^T
    K00, K10, K11 = _gram(ck0, ck0, PREC), _gram(ck1, ck0, PREC), _gram(ck1, ck1, PREC)
    K20, K21, K22 = _gram(ck2, ck0, PREC), _gram(ck2, ck1, PREC), _gram(ck2, ck2, PREC)
    K30, K31, K32, K33 = _gram(ck3, ck0, PREC), _gram(ck3, ck1, PREC), _gram(ck3, ck2, PREC), _gram(ck3, ck3, PREC)
    if DIR_SOURCE == "q":
        Q00, Q10, Q11 = _gram(cq0, ck0, PREC), _gram(cq1, ck0, PREC), _gram(cq1, ck1, PREC)
        Q20, Q21, Q22 = _gram(cq2, ck0, PREC), _gram(cq2, ck1, PREC), _gram(cq2, ck2, PREC)
        Q30, Q31, Q32, Q33 = _gram(cq3, ck0, PREC), _gram(cq3, ck1, PREC), _gram(cq3, ck2, PREC), _gram(cq3, ck3, PREC)
    else:
        Q00, Q10, Q11, Q20, Q21, Q22, Q30, Q31, Q32, Q33 = K00, K10, K11, K20, K21, K22, K30, K31, K32, K33
    M: tl.constexpr = HV // H
    for i in range(M):
        i_hv = i_h * M + i
        x0, xk0 = _direction(z, d_in, cq0, ck0, qk0, r0, m0, o_k, m_k, i_hv, HV, K, DIR_SOURCE, DT)
        x1, xk1 = _direction(z, d_in, cq1, ck1, qk1, r1, m1, o_k, m_k, i_hv, HV, K, DIR_SOURCE, DT)
        x2, xk2 = _direction(z, d_in, cq2, ck2, qk2, r2, m2, o_k, m_k, i_hv, HV, K, DIR_SOURCE, DT)
        x3, xk3 = _direction(z, d_in, cq3, ck3, qk3, r3, m3, o_k, m_k, i_hv, HV, K, DIR_SOURCE, DT)
        G0, al0, ga0, bx0, c_0 = _row_gates(g, b, lam, r0, m0, 0., xk0, i_hv, HV, LAM_TOKEN, DIR_SOURCE, DIR_GATED,
                                            DIR_PROJECTED, DT)
        G1, al1, ga1, bx1, c_1 = _row_gates(g, b, lam, r1, m1, _last_row(G0, BC), xk1, i_hv, HV, LAM_TOKEN, DIR_SOURCE,
                                            DIR_GATED, DIR_PROJECTED, DT)
        G2, al2, ga2, bx2, c_2 = _row_gates(g, b, lam, r2, m2, _last_row(G1, BC), xk2, i_hv, HV, LAM_TOKEN, DIR_SOURCE,
                                            DIR_GATED, DIR_PROJECTED, DT)
        G3, al3, ga3, bx3, c_3 = _row_gates(g, b, lam, r3, m3, _last_row(G2, BC), xk3, i_hv, HV, LAM_TOKEN, DIR_SOURCE,
                                            DIR_GATED, DIR_PROJECTED, DT)
        i00 = diagonal_inverse(_a_block(K00, _xk(Q00, x0, ck0, xk0, DIR_SOURCE, PREC), al0, ga0, G0, G0, True, BC), BC)
        i11 = diagonal_inverse(_a_block(K11, _xk(Q11, x1, ck1, xk1, DIR_SOURCE, PREC), al1, ga1, G1, G1, True, BC), BC)
        i22 = diagonal_inverse(_a_block(K22, _xk(Q22, x2, ck2, xk2, DIR_SOURCE, PREC), al2, ga2, G2, G2, True, BC), BC)
        i33 = diagonal_inverse(_a_block(K33, _xk(Q33, x3, ck3, xk3, DIR_SOURCE, PREC), al3, ga3, G3, G3, True, BC), BC)
        a10 = _a_block(K10, _xk(Q10, x1, ck0, xk0, DIR_SOURCE, PREC), al1, ga1, G1, G0, False, BC)
        a20 = _a_block(K20, _xk(Q20, x2, ck0, xk0, DIR_SOURCE, PREC), al2, ga2, G2, G0, False, BC)
        a21 = _a_block(K21, _xk(Q21, x2, ck1, xk1, DIR_SOURCE, PREC), al2, ga2, G2, G1, False, BC)
        a30 = _a_block(K30, _xk(Q30, x3, ck0, xk0, DIR_SOURCE, PREC), al3, ga3, G3, G0, False, BC)
        a31 = _a_block(K31, _xk(Q31, x3, ck1, xk1, DIR_SOURCE, PREC), al3, ga3, G3, G1, False, BC)
        a32 = _a_block(K32, _xk(Q32, x3, ck2, xk2, DIR_SOURCE, PREC), al3, ga3, G3, G2, False, BC)
        i10, i20, i21, i30, i31, i32 = merge_blocks(i00, i11, i22, i33, a10, a20, a21, a30, a31, a32, PREC)
        store_inverse(ai + i_hv * BT, c0, eos, i00, i10, i11, i20, i21, i22, i30, i31, i32, i33, HV, BT, BC)
        _store_rows(gc, alpha, gamma, rho, eig, cp, d_out, r0, m0, o_k, m_k, i_hv, G0, al0, ga0, bx0, c_0, kk0, qk0,
                    xk0, x0, ck0, HV, K, DT, PROBES)
        _store_rows(gc, alpha, gamma, rho, eig, cp, d_out, r1, m1, o_k, m_k, i_hv, G1, al1, ga1, bx1, c_1, kk1, qk1,
                    xk1, x1, ck1, HV, K, DT, PROBES)
        _store_rows(gc, alpha, gamma, rho, eig, cp, d_out, r2, m2, o_k, m_k, i_hv, G2, al2, ga2, bx2, c_2, kk2, qk2,
                    xk2, x2, ck2, HV, K, DT, PROBES)
        _store_rows(gc, alpha, gamma, rho, eig, cp, d_out, r3, m3, o_k, m_k, i_hv, G3, al3, ga3, bx3, c_3, kk3, qk3,
                    xk3, x3, ck3, HV, K, DT, PROBES)


def gram_warps(K: int) -> int:
    """Warps of the Gram stage, by rule: 4 (its ``[16, K]`` row blocks and ``[16, 16]`` products
    are small; the forward substitution's row reductions want few warps)."""
    return 4


def scalar_gram_fwd(x: DirectionInputs, g: torch.Tensor, *, lay: ChunkLayout, inter_dtype: torch.dtype,
                    probes: bool, config: tuple[int, int] | None = None) -> ScalarGram:
    """Launch ``qed_scalar_gram_kernel`` (grid: chunks x query/key heads) on per-head ``g`` and
    ``x.b`` (``[B, T, HV]``). ``config`` ``(num_warps, num_stages)`` overrides the rule (for
    screening)."""
    num_warps, num_stages = config or (gram_warps(x.q.shape[-1]), 1)
    B, T, H, K = x.q.shape
    HV = g.shape[2]
    dev, st = g.device, lay.state_dtype
    row = lambda: torch.empty(B, T, HV, device=dev, dtype=st)  # noqa: E731
    out = ScalarGram(qn=torch.empty(B, T, H, K, device=dev, dtype=inter_dtype),
                     kn=torch.empty(B, T, H, K, device=dev, dtype=inter_dtype),
                     gc=row(), alpha=row(), gamma=row(), ai=torch.empty(B, T, HV, BT, device=dev, dtype=inter_dtype),
                     rho=row() if probes else None, e=row() if probes else None, c=row() if probes else None,
                     d=torch.empty(B, T, HV, K, device=dev, dtype=st) if probes else None)
    qed_scalar_gram_kernel[(lay.grid[0], lay.grid[1] * H // HV)](
        q=x.q, k=x.k, g=g, b=x.b, lam=x.lam, z=x.z, d_in=x.d,
        qn=out.qn, kn=out.kn, gc=out.gc, alpha=out.alpha, gamma=out.gamma, ai=out.ai,
        rho=out.rho, eig=out.e, cp=out.c, d_out=out.d,
        cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T,
        H=H, HV=HV, K=K, BT=BT, BC=BC, BK=triton.next_power_of_2(K), L2NORM=x.l2norm,
        DIR_SOURCE=x.flags["DIR_SOURCE"], DIR_GATED=x.flags["DIR_GATED"], DIR_PROJECTED=x.flags["DIR_PROJECTED"],
        DT=lay.DT, PREC=lay.prec, num_warps=num_warps, num_stages=num_stages,
    )
    return out
