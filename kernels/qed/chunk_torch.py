r"""Chunked QED forward in plain PyTorch: the fast, differentiable path for CPU tensors.

Same recurrence as ``naive.py``; the same chunk algorithm as the Triton ``chunk.py``, written
with dense tensors (chunks of ``CHUNK`` tokens, ``G`` the inclusive cumsum of ``g`` inside a
chunk, ``S0`` the chunk-start state)::

    Dec[t,j,c] = exp(G_{t,c} - G_{j,c})                   (j <= t, formed exactly per element)
    A_kk[t,j]  = sum_c a_{t,c} k_{j,c} Dec[t,j,c]          (j < t)
    R          = (I + A_kk)^{-1} (W V - (a e^G) S0)        (the residuals r_t of the chunk)
    o_t        = (scale q_t e^{G_t})^T S0 + sum_{j<=t} scale (q_t . k_j)_Dec r_j
    Sd_t       = (d_t e^{G_t})^T S0 + sum_{j<t} (d_t . k_j)_Dec r_j
    S_next     = Diag(e^{G_last}) S0 + sum_j (k_j e^{G_last - G_j}) r_j^T

The scores are formed by sub-chunks of ``SUB`` rows, as the Triton kernels do: ``Dec`` exactly
per element only inside a sub-chunk's diagonal ``SUB x SUB`` block, and the pairs before it as one
product through the sub-chunk's first row ``r``, ``exp(G_t - G_j) = exp(G_t - G_r) exp(G_r - G_j)``,
both factors at most 1 (``j < r <= t``), so nothing overflows and a factor that underflows
stands for a pair whose exact decay is smaller still. That is ``B * H * CHUNK * SUB * K``
elements per chunk instead of ``CHUNK^2 * K``, formed for a few chunks at a time; with autograd
every block is kept for the backward. Meant for small models (notebooks, tests, CPU evaluation)
and as an autograd path, not for 340M-scale GPU work.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .inputs import QEDOutput
from .naive import Tensor, run_scan

CHUNK = 32
SUB = 8
"""Rows of a sub-chunk: the diagonal blocks whose decay is formed per element."""
SCORE_BLOCK = 1 << 22
"""Elements of the largest decay tensor formed at once (16 MiB in float32)."""


def _chunked(x: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """``[B, T_pad, H, D]`` -> ``[B, H, NT, CHUNK, D]``."""
    B, _, H, D = x.shape
    return x.view(B, n_chunks, CHUNK, H, D).permute(0, 3, 1, 2, 4)


def _decayed_scores(G: torch.Tensor, k: torch.Tensor, rows: list, causal: torch.Tensor) -> list:
    """``sum_c x_{t,c} k_{j,c} exp(G_{t,c} - G_{j,c})`` masked by ``mask[t, j]`` for each ``(x, mask)``
    of ``rows``, all ``[B, H, NT, CHUNK, *]``: ``[B, H, NT, CHUNK, CHUNK]`` each (``causal``, the
    ``[CHUNK, CHUNK]`` lower triangle, keeps ``exp`` off the pairs ``j > t``). Per sub-chunk ``I``
    of ``SUB`` rows (see the module doc): the pairs with ``j`` before it as the product
    ``(x_t e^{G_t - G_r}) . (k_j e^{G_r - G_j})``, the pairs inside it with ``Dec`` per element.
    Formed for a block of chunks at a time (about ``SCORE_BLOCK`` elements of the largest
    tensor), so that memory stays bounded whatever the batch."""
    B, H, NT, C, K = k.shape
    ns = C // SUB
    sub = lambda x: x.unflatten(-2, (ns, SUB))  # noqa: E731  [.., C, K] -> [.., ns, SUB, K]
    cols = torch.arange(C, device=k.device)
    before = cols[None, :] < (torch.arange(ns, device=k.device) * SUB)[:, None]  # [ns, C]: j before sub-chunk I
    diag_causal = causal[:SUB, :SUB]
    step = max(1, SCORE_BLOCK // (B * H * C * SUB * K))
    blocks = [[] for _ in rows]
    for n0 in range(0, NT, step):
        Gb, kb = G[:, :, n0:n0 + step], k[:, :, n0:n0 + step]
        Gs, ks = sub(Gb), sub(kb)
        ref = Gs[..., :1, :]                                            # [.., ns, 1, K]: G_r
        k_ref = (ref - Gb.unsqueeze(-3)).masked_fill(~before[..., None], float("-inf")).exp() * kb.unsqueeze(-3)
        dec = (Gs.unsqueeze(-2) - Gs.unsqueeze(-3)).masked_fill(~diag_causal[..., None], float("-inf")).exp()
        row_decay = (Gs - ref).exp()                                   # [.., ns, SUB, K]: e^{G_t - G_r}
        for out, (x, mask) in zip(blocks, rows):
            xs = sub(x[:, :, n0:n0 + step])
            earlier = (xs * row_decay) @ k_ref.transpose(-1, -2)       # [.., ns, SUB, C], zero from r on
            inside = (xs.unsqueeze(-2) * ks.unsqueeze(-3) * dec).sum(-1)  # [.., ns, SUB, SUB]
            pad = [F.pad(inside[..., i, :, :], (i * SUB, C - (i + 1) * SUB)) for i in range(ns)]
            out.append((earlier + torch.stack(pad, -3)).flatten(-3, -2) * mask)
    return [torch.cat(out, 2) for out in blocks]


def chunk_scan(q, k, wv, g, a, d, scale, state, want_sd):
    """Chunked scan over ``[B, T, H, *]`` tensors from ``state`` ``[B, H, K, V]`` (see module doc)."""
    B, T, H, _ = q.shape
    pad = -T % CHUNK
    n_chunks = (T + pad) // CHUNK
    # Padded tokens have k = a = wv = 0 and g = 0: they leave the state untouched.
    q, k, wv, g, a, d = (_chunked(F.pad(x, (0, 0, 0, 0, 0, pad)), n_chunks) for x in (q, k, wv, g, a, d))
    G = g.cumsum(-2)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    strict = torch.ones_like(causal).tril(-1)
    rows = [(a, strict), (q, causal)] + ([(d, strict)] if want_sd else [])
    a_kk, q_k, *d_k = _decayed_scores(G, k, rows, causal)
    eye = torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    lower = eye + a_kk
    u = torch.linalg.solve_triangular(lower, wv, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, a * G.exp(), upper=False, unitriangular=True)
    a_qk = scale * q_k
    a_dk = d_k[0] if want_sd else None
    qg, dg = scale * q * G.exp(), d * G.exp()
    k_tail = k * (G[..., -1:, :] - G).exp()
    outs, sds = [], []
    for n in range(n_chunks):
        r = u[:, :, n] - w[:, :, n] @ state
        outs.append(qg[:, :, n] @ state + a_qk[:, :, n] @ r)
        if want_sd:
            sds.append(dg[:, :, n] @ state + a_dk[:, :, n] @ r)
        state = state * G[:, :, n, -1].exp().unsqueeze(-1) + k_tail[:, :, n].transpose(-1, -2) @ r
    unchunk = lambda xs: torch.stack(xs, 2).flatten(2, 3).transpose(1, 2)[:, :T]  # noqa: E731
    return unchunk(outs), state, unchunk(sds) if want_sd else None


def qed_chunk_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, b: Tensor, w: Tensor, lam: Tensor, *,
                    arm: str = "full", z: Tensor | None = None, d: Tensor | None = None, scale: float | None = None,
                    initial_state: Tensor | None = None, output_final_state: bool = False,
                    return_probes: bool = False, use_qk_l2norm: bool = True,
                    cu_seqlens: Tensor | None = None) -> QEDOutput:
    """Chunked PyTorch QED forward (differentiable; any device, any float dtype).

    Args:
        q, k, v, g, b, w, lam: as :func:`~qedprobe.kernels.qed.naive.qed_naive` (``q, k``
            ``[B, T, H, K]``; ``v`` ``[B, T, HV, V]``; gates per channel or ``[B, T, HV]``;
            ``lam`` ``[HV]`` or ``[B, T, HV]``).
        arm, z, d, scale, initial_state, output_final_state, return_probes, use_qk_l2norm,
            cu_seqlens: as ``qed_naive``.

    Returns:
        ``(o, final_state, probes)`` as ``qed_naive``, equal to it up to rounding.
    """
    return run_scan("qed_chunk_torch", chunk_scan, q, k, v, g, b, w, lam, arm=arm, z=z, d=d, scale=scale,
                    initial_state=initial_state, output_final_state=output_final_state,
                    return_probes=return_probes, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens)
