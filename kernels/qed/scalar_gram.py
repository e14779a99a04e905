r"""Scalar-gate path of ``qed_chunk``, stage 1: normalised keys and queries and their Gram matrices,
once per query/key head; from them the erase scores ``A_kk`` of each value head.

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

``qed_scalar_gram_kernel`` (one program per chunk and query/key head, by default): loads the raw
``q, k`` of the chunk once and normalises them. Where :func:`folds_norms` says so it stores only
their reciprocal norms and the later stages read the raw ``q, k``, which they load anyway: the W/U
stage puts the keys' norms on the rows of ``W, U`` (so the scan's residuals carry them and pair
with the raw keys), the output stage applies the queries' norms to its rows at the store; the
normalised vectors, which fla's ``l2norm`` kernel writes and its later kernels read, never go
through memory. Otherwise it stores ``q_hat, k_hat`` for the scan and the output stage. The W/U
stage reads the raw ``q, k`` either way. It forms ``K K^T`` and ``Q K^T`` once (of the raw tiles
as loaded, rows and columns scaled by the norms' factors afterwards), then for each of the ``HV /
H`` value heads of its group: ``G`` (the decay's cumsum), ``alpha, gamma`` (stored per row for the
W/U stage times the raw vectors' reciprocal norms, so that ``a_t = (alpha_t r_k) k_t + (gamma_t
r_x) x_t`` there from the raw rows) and ``A_kk`` (:func:`scores_dtype`, for
``chunk_wy.qed_inverse_kernel``); with probes ``rho, e`` and ``c``, the flags of the chunks whose
``Sd`` the output stage must form from the direction rows (``patch``), and ``d`` when it is asked for:
in the same pass (``D_LATE`` off) or in a second pass over the group from the raw tiles loaded
again (from L2), so that they are not held in registers through the first pass's products.
Each exponent ``G_t - G_j`` (``j <= t``) is ``<= 0`` for any ``g <= 0``; the pairs above the
diagonal are zeroed before the exponential.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .chunk_common import TL_DTYPES, BT, ChunkLayout, chunk_position, exp, heads_first, load_tile, store_tile
from .chunk_intra import DirectionInputs, row_lam


@dataclass(frozen=True)
class ScalarGram:
    """What the Gram stage writes for the later stages: either ``rq, rk`` ``[B, T, H]`` (the
    queries' and keys' reciprocal norms, state dtype) or ``qn, kn`` ``[B, T, H, K]`` (the
    normalised queries and keys, intermediate dtype), the others ``None`` (all four without the L2
    norm: the inputs are the normalised vectors then); per row and value head
    ``[B, T, HV]`` (state dtype) ``gc`` (``G``), ``alpha, gamma`` (times the reciprocal norms of the
    raw keys and of the raw direction rows: the coefficients of the raw rows in the erase vector).
    Probes (else ``None``): ``rho, e, c`` ``[B, T, HV]`` and ``d``
    ``[B, T, HV, K]`` in the state dtype; ``patch`` ``[NC, HV]`` (int8, else ``None``): 1 for the
    chunks and value heads with a row whose ``1 - lam rho`` is below the output stage's bound
    (``chunk_scan.sd_patched``). (The scores ``A_kk`` are returned beside it: only the block
    inverse reads them.)"""

    rq: torch.Tensor | None
    rk: torch.Tensor | None
    qn: torch.Tensor | None
    kn: torch.Tensor | None
    gc: torch.Tensor
    alpha: torch.Tensor
    gamma: torch.Tensor
    rho: torch.Tensor | None
    e: torch.Tensor | None
    c: torch.Tensor | None
    d: torch.Tensor | None
    patch: torch.Tensor | None

    def qk_rows(self, x: DirectionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries and keys ``[B, T, H, K]`` the scan and the output stage read: ``q_hat,
        k_hat`` where stored, else the raw ``x.q, x.k`` (with ``rq, rk`` to fold in, or already
        normalised)."""
        if self.kn is not None:
            return self.qn, self.kn
        return x.q, x.k


@triton.jit
def _direction_tiles(z, d_in, f_q, r_q, f_k, r_k, c_k, qk, XK_q, rows, m_t, o_k, m_k, i_hv, HV: tl.constexpr,
                     K: tl.constexpr, DIR_SOURCE: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """For value head ``i_hv``: ``(x, xs, xk, XK)``, the arm's raw direction of row ``t`` being
    ``xs_t x_t``: the tile ``x`` ``[BT, BK]`` (``DT``) and its row factors ``xs`` (the queries'
    reciprocal norms for a direction from ``q``, else ones), ``xk_t = xs_t x_t . k_hat_t`` and
    ``XK[t, j] = xs_t x_t . k_hat_j`` (the query/key head's ``Q K^T`` for a direction from ``q``; for
    ``z`` one row broadcast; for a given ``d`` its product with the raw keys ``c_k``, columns scaled
    by their reciprocal norms ``r_k``). ``f_q, f_k``: the raw queries and keys (``DT``), ``qk`` the
    rows' ``q_hat . k_hat``."""
    ones = r_k * 0. + 1.
    if DIR_SOURCE == "z":
        zz = tl.load(z + i_hv * K + o_k, mask=m_k, other=0.).to(DT)
        x = f_k * 0. + zz[None, :]
        xs = ones
        xk = tl.sum(f_k * zz[None, :], 1) * r_k
        XK = xk[None, :] + tl.zeros_like(XK_q)
    elif DIR_SOURCE == "d":
        x = load_tile(d_in + i_hv * K, rows, m_t, o_k, m_k, HV * K, DT)
        xs = ones
        xk = tl.sum(x * f_k, 1) * r_k
        XK = tl.dot(x.to(c_k.dtype), tl.trans(c_k), input_precision=PREC).to(DT) * r_k[None, :]
    elif DIR_SOURCE == "q":
        x = f_q
        xs = r_q
        xk = qk
        XK = XK_q
    else:
        x = f_k * 0.
        xs = ones
        xk = r_k * 0.
        XK = XK_q * 0.
    return x, xs, xk, XK


@triton.jit
def _direction_gates(b_b, xk, DIR_GATED: tl.constexpr, DIR_PROJECTED: tl.constexpr):
    """``(bx, c)`` per row: the direction's gate (``b`` for the gated arms, else 1) and its
    component along the key, ``c = bx xk`` for the projected arms (else 0)."""
    bx = b_b if DIR_GATED else b_b * 0. + 1.
    c = bx * xk if DIR_PROJECTED else xk * 0.
    return bx, c


@triton.jit
def _direction_rows(x, xs, bx, c, r_k, f_k):
    """``d = (bx xs) x - (c r_k) k`` ``[BT, BK]``: the probe ``d`` of one value head from its raw
    direction rows ``x`` and raw keys ``f_k`` with their row factors."""
    return (bx * xs)[:, None] * x - (c * r_k)[:, None] * f_k


@triton.heuristics({
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
    "PROBES": lambda args: args["rho"] is not None,
    "WRITE_D": lambda args: args["d_out"] is not None,
    "LAM_TOKEN": lambda args: args["lam"].dim() == 3,
    "STORE_HATS": lambda args: args["qn"] is not None,
    "FLAG_PATCH": lambda args: args["patch"] is not None,
})
@triton.jit(do_not_specialize=["T"])
def qed_scalar_gram_kernel(
    q, k, g, b, lam, z, d_in,
    rq, rk, qn, kn, gc, alpha, gamma, akk, rho, eig, cp, d_out, patch,
    cu_seqlens, chunk_indices, T, patch_below,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    IT: tl.constexpr, L2NORM: tl.constexpr, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr,
    DIR_PROJECTED: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, LAM_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr, PROBES: tl.constexpr,
    WRITE_D: tl.constexpr, STORE_HATS: tl.constexpr, HEADS_FIRST: tl.constexpr, VH_BLOCK: tl.constexpr,
    D_LATE: tl.constexpr, FLAG_PATCH: tl.constexpr,
):
    M: tl.constexpr = HV // H
    PARTS: tl.constexpr = M // VH_BLOCK  # programs per query/key head and chunk
    i_p, i_t, i_g, bos, eos = chunk_position(cu_seqlens, chunk_indices, T, H * PARTS, BT, IS_VARLEN, HEADS_FIRST)
    i_h = i_p // PARTS
    o_t = tl.arange(0, BT)
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    c_q = load_tile(q + i_h * K, rows, m_t, o_k, m_k, H * K, IT)
    c_k = load_tile(k + i_h * K, rows, m_t, o_k, m_k, H * K, IT)
    f_q = c_q.to(DT)
    f_k = c_k.to(DT)
    r_q = tl.full([BT], 1., DT)
    r_k = tl.full([BT], 1., DT)
    if L2NORM:
        r_q = 1. / tl.sqrt(tl.sum(f_q * f_q, 1) + 1e-6)
        r_k = 1. / tl.sqrt(tl.sum(f_k * f_k, 1) + 1e-6)
        if i_p % PARTS == 0:  # by the first program of the query/key head's group
            if STORE_HATS:
                store_tile(qn + i_h * K, f_q * r_q[:, None], rows, m_t, o_k, m_k, H * K)
                store_tile(kn + i_h * K, f_k * r_k[:, None], rows, m_t, o_k, m_k, H * K)
            else:
                tl.store(rq + rows * H + i_h, r_q.to(rq.dtype.element_ty), mask=m_t)
                tl.store(rk + rows * H + i_h, r_k.to(rk.dtype.element_ty), mask=m_t)
    # sums and products of the raw tiles, normalised afterwards by the norms' factors: no normalised
    # tile is formed (fewer registers)
    kk = tl.sum(f_k * f_k, 1) * (r_k * r_k)
    qk = tl.sum(f_q * f_k, 1) * (r_q * r_k)
    KK = tl.dot(c_k, tl.trans(c_k), input_precision=PREC).to(DT) * (r_k[:, None] * r_k[None, :])
    XK_q = (tl.dot(c_q, tl.trans(c_k), input_precision=PREC).to(DT) * (r_q[:, None] * r_k[None, :])
            if DIR_SOURCE == "q" else KK * 0.)
    strict = o_t[:, None] > o_t[None, :]
    for i in range(VH_BLOCK):
        i_hv = i_p * VH_BLOCK + i
        p = rows * HV + i_hv
        G = tl.cumsum(tl.load(g + p, mask=m_t, other=0.).to(DT), 0)
        b_b = tl.load(b + p, mask=m_t, other=0.).to(DT)
        b_l = row_lam(lam + i_hv, rows, m_t, HV, LAM_TOKEN, DT)
        x, xs, xk, XK = _direction_tiles(z, d_in, f_q, r_q, f_k, r_k, c_k, qk, XK_q, rows, m_t, o_k, m_k, i_hv, HV,
                                         K, DIR_SOURCE, DT, PREC)
        bx, c = _direction_gates(b_b, xk, DIR_GATED, DIR_PROJECTED)
        b_al = b_b - b_l * c
        b_ga = b_l * bx if DIR_SOURCE != "none" else b_l * 0.
        tl.store(gc + p, G.to(gc.dtype.element_ty), mask=m_t)
        tl.store(alpha + p, (b_al * r_k).to(alpha.dtype.element_ty), mask=m_t)
        tl.store(gamma + p, (b_ga * xs).to(gamma.dtype.element_ty), mask=m_t)
        dec = exp(tl.where(strict, G[:, None] - G[None, :], 0.))
        A = tl.where(strict, (b_al[:, None] * KK + b_ga[:, None] * XK) * dec, 0.)
        store_tile(akk + i_hv * BT, A, rows, m_t, o_t, o_t < BT, HV * BT)
        if PROBES:
            tl.store(rho + p, qk.to(rho.dtype.element_ty), mask=m_t)
            tl.store(eig + p, (1. - b_al * kk - b_ga * xk).to(eig.dtype.element_ty), mask=m_t)
            tl.store(cp + p, c.to(cp.dtype.element_ty), mask=m_t)
        if FLAG_PATCH:
            tl.store(patch + i_g * HV + i_hv, (tl.max(tl.where(m_t, b_l * xk, 0.), 0) > 1. - patch_below).to(tl.int8))
        if WRITE_D and not D_LATE:
            store_tile(d_out + i_hv * K, _direction_rows(x, xs, bx, c, r_k, f_k), rows, m_t, o_k, m_k, HV * K)
    if WRITE_D and D_LATE:
        # a second pass over the group, from the raw tiles loaded again (from L2), so that the
        # first pass does not hold them in registers through its products
        f_q = load_tile(q + i_h * K, rows, m_t, o_k, m_k, H * K, DT)
        f_k = load_tile(k + i_h * K, rows, m_t, o_k, m_k, H * K, DT)
        for i in range(VH_BLOCK):
            i_hv = i_p * VH_BLOCK + i
            b_b = tl.load(b + rows * HV + i_hv, mask=m_t, other=0.).to(DT)
            x, xs, xk, _ = _direction_tiles(z, d_in, f_q, r_q, f_k, r_k, c_k, qk, XK_q, rows, m_t, o_k, m_k, i_hv,
                                            HV, K, DIR_SOURCE, DT, PREC)
            bx, c = _direction_gates(b_b, xk, DIR_GATED, DIR_PROJECTED)
            store_tile(d_out + i_hv * K, _direction_rows(x, xs, bx, c, r_k, f_k), rows, m_t, o_k, m_k, HV * K)


def scores_dtype(inter_dtype: torch.dtype, state_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the erase scores ``A_kk`` between the Gram stage and the block inverse:
    float16 where the intermediates are bf16, else the state dtype. With bf16 intermediates the
    inverse multiplies its off-diagonal score blocks in tf32, whose 10-bit mantissa is float16's,
    so storing them as float16 loses nothing there (only the diagonal blocks' forward substitution,
    in float32, sees their rounding, 2^-11 relative) and halves the bytes of the round trip, which
    fla avoids by solving in the kernel that forms its scores. The scores are bounded (``|A| <=
    |alpha| + |gamma|``, normalised keys and directions, decays <= 1): float16's range holds them."""
    return torch.float16 if inter_dtype == torch.bfloat16 else state_dtype


def gram_warps(K: int) -> int:
    """Warps of the Gram stage, by rule: 4 for key tiles up to 64 channels, 8 above (two
    ``[64, K]`` tiles and two ``[64, 64]`` products per program)."""
    return 4 if triton.next_power_of_2(K) <= 64 else 8


def folds_norms(H: int, HV: int, writes_d: bool) -> bool:
    """Whether the later stages fold the queries' and keys' reciprocal norms in (the Gram stage
    stores only them) rather than read normalised ``q_hat, k_hat`` from memory, by rule: where
    each query/key head has one value head and the direction probe ``d`` is not written. Folding
    saves the Gram stage the stores of ``q_hat, k_hat`` but costs the W/U and output stages per
    value head (the factors' loads and products in every program); with several value heads
    per query/key head, or with ``d`` (whose Gram stage gains least), the cost is the larger
    (docs/BENCHMARKS.md)."""
    return HV == H and not writes_d


GRAM_MAXNREG = 128
"""Register cap (ptxas ``.maxnreg``) of the Gram stage in 8 warps: two programs per SM, where
ptxas alone takes enough registers with probes for only one (docs/BENCHMARKS.md has the counts
and the timings)."""


def gram_config(K: int, group: int, probes: bool, direction: bool = True) -> tuple[int, int, int, int | None, bool]:
    """``(num_warps, num_stages, value heads per program, maxnreg, d_late)`` of the Gram stage for
    ``group`` value heads per query/key head, with ``probes`` written (``d`` too with
    ``direction``), by rule: one stage, the whole group in one program (its Gram matrices formed
    once) in :func:`gram_warps`, capped at :data:`GRAM_MAXNREG` registers in 8 warps, ``d`` (if
    asked) in a second pass; in ptxas' registers with ``d`` in the first pass where the probes
    include ``d`` and the group has two or more value heads, and where it has four or more (the
    second pass reloads the raw tiles and forms each value head's direction again, which there
    costs more than the registers it saves, while without ``d`` the cap still pays with two value
    heads per group: the op rows in docs/BENCHMARKS.md)."""
    warps = gram_warps(K)
    if probes and (group >= 4 or (direction and group >= 2)):
        return warps, 1, group, None, False
    return warps, 1, group, GRAM_MAXNREG if warps == 8 else None, True


def scalar_gram_fwd(x: DirectionInputs, g: torch.Tensor, *, lay: ChunkLayout, inter_dtype: torch.dtype,
                    probes: bool, direction: bool = True, patch_below: float | None = None,
                    config: tuple[int, int, int, int | None, bool] | None = None) -> tuple[ScalarGram, torch.Tensor]:
    """Launch ``qed_scalar_gram_kernel`` (grid: query/key heads x chunks,
    :func:`~.chunk_common.heads_first`) on per-head ``g`` and ``x.b`` (``[B, T, HV]``); with
    ``probes`` it writes ``rho, e, c``, with ``direction`` too ``d``, and with ``patch_below``
    ``patch``: which chunks of which value heads have a row with ``1 - lam rho < patch_below``
    (``rho`` the arm's ``x . k_hat``). Returns ``(gram, akk)``,
    ``akk`` the scores ``[B, T, HV, BT]`` (:func:`scores_dtype`) apart so that the caller can free
    them once inverted; the norms are folded or ``q_hat, k_hat`` stored as :func:`folds_norms`
    rules. ``config`` ``(num_warps, num_stages, value heads per program, maxnreg, d_late)``
    overrides :func:`gram_config` for screening (a divisor of the group spreads it over more
    programs, each forming the Gram matrices again; ``d_late`` writes ``d`` in a second pass)."""
    B, T, H, K = x.q.shape
    HV = g.shape[2]
    num_warps, num_stages, vh_block, maxnreg, d_late = config or gram_config(K, HV // H, probes, direction)
    if vh_block < 1 or (HV // H) % vh_block:
        raise ValueError(f"scalar_gram_fwd: config's value heads per program must be a positive divisor of "
                         f"HV // H = {HV // H}, got {vh_block}")
    dev, st = g.device, lay.state_dtype
    row = lambda: torch.empty(B, T, HV, device=dev, dtype=st)  # noqa: E731
    fold = folds_norms(H, HV, probes and direction)
    norms = lambda: torch.empty(B, T, H, device=dev, dtype=st) if x.l2norm and fold else None  # noqa: E731
    hats = lambda: (torch.empty(B, T, H, K, device=dev, dtype=inter_dtype)  # noqa: E731
                    if x.l2norm and not fold else None)
    out = ScalarGram(rq=norms(), rk=norms(), qn=hats(), kn=hats(),
                     gc=row(), alpha=row(), gamma=row(),
                     rho=row() if probes else None, e=row() if probes else None, c=row() if probes else None,
                     d=torch.empty(B, T, HV, K, device=dev, dtype=st) if (probes and direction) else None,
                     patch=torch.empty(lay.NC, HV, device=dev, dtype=torch.int8) if (probes and patch_below) else None)
    akk = torch.empty(B, T, HV, BT, device=dev, dtype=scores_dtype(inter_dtype, st))
    grid, first = heads_first((lay.grid[0], lay.grid[1] // vh_block))
    qed_scalar_gram_kernel[grid](
        q=x.q, k=x.k, g=g, b=x.b, lam=x.lam, z=x.z, d_in=x.d,
        rq=out.rq, rk=out.rk, qn=out.qn, kn=out.kn, gc=out.gc, alpha=out.alpha, gamma=out.gamma, akk=akk,
        rho=out.rho, eig=out.e, cp=out.c, d_out=out.d, patch=out.patch,
        cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T, patch_below=float(patch_below or 0.),
        H=H, HV=HV, K=K, BT=BT, BK=triton.next_power_of_2(K), IT=TL_DTYPES[inter_dtype], L2NORM=x.l2norm,
        DIR_SOURCE=x.flags["DIR_SOURCE"], DIR_GATED=x.flags["DIR_GATED"], DIR_PROJECTED=x.flags["DIR_PROJECTED"],
        DT=lay.DT, PREC=lay.prec, HEADS_FIRST=first, VH_BLOCK=vh_block, D_LATE=d_late, num_warps=num_warps,
        num_stages=num_stages, maxnreg=maxnreg,
    )
    return out, akk
