r"""Plain PyTorch reference of the QED recurrence: the oracle for every kernel.

Per sequence, head and token (state ``S`` is ``K x V``, float32 or float64)::

    q_hat, k_hat = q / ||q||, k / ||k||            (when use_qk_l2norm)
    S_bar_t = Diag(exp g_t) S_{t-1}                 (decay first)
    a_t     = b_t * k_hat_t + lam_t d_t             (d_t: the arm's direction, see arms.py)
    r_t     = w_t * v_t - S_bar_t^T a_t             (residual)
    S_t     = S_bar_t + k_hat_t r_t^T               (rank-one write along k_hat_t)
    o_t     = S_t^T (scale * q_hat_t)

Probes, per token and value head: ``rho_t = q_hat_t . k_hat_t``, ``d_t``,
``Sd_t = S_bar_t^T d_t`` and the erase eigenvalue ``e_t = 1 - a_t . k_hat_t``.

Grouped value heads (fla's GDN-2 convention): ``HV = m * H`` states, value head ``j`` reads
query/key head ``j // m``; everything else (``v, w, g, b, lam, d, z``, states, probes) is per
value head. The reference expands ``q, k`` to ``HV`` heads (``repeat_interleave``), so their
gradients are the sums over each group.
"""
from __future__ import annotations

import torch

from .arms import erase_direction, erase_vector
from .inputs import QEDOutput, check_qed_inputs, probe_request

Tensor = torch.Tensor

L2NORM_EPS = 1e-6
"""As fla's l2norm: ``x / sqrt(sum x^2 + eps)``."""


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` along the last axis, exactly as fla's ``l2norm``."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def expand_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, T, H, K]`` -> ``[B, T, H * group, K]``: value head ``j`` gets head ``j // group``."""
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def channel_gates(g: torch.Tensor, b: torch.Tensor, w: torch.Tensor, problem) -> tuple:
    """The gates as broadcastable per-channel tensors: a per-head gate ``[B, T, HV]`` becomes the
    view ``[B, T, HV, 1]``, which broadcasts over ``K`` (``g, b``) or ``V`` (``w``) wherever the
    per-channel ``[B, T, HV, K]`` / ``[B, T, HV, V]`` form would be used (no copy)."""
    P = problem
    return (g.unsqueeze(-1) if P.head_g else g, b.unsqueeze(-1) if P.head_b else b,
            w.unsqueeze(-1) if P.head_w else w)


def prepare_qed(q, k, b, lam, arm, z, d, use_qk_l2norm, problem):
    """Normalised ``q, k`` expanded to the value heads, per-token ``lam`` ``[B, T, HV]``,
    direction ``d`` and erase vector ``a`` (all ``[B, T, HV, *]``).

    All in ``problem.compute_dtype``; shared by the reference, the PyTorch chunk path and the
    Triton backward's input map.
    """
    ct = problem.compute_dtype
    q, k, b = q.to(ct), k.to(ct), b.to(ct)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q, k = expand_heads(q, problem.group), expand_heads(k, problem.group)
    lam = lam.to(ct)
    if lam.dim() == 1:
        lam = lam.expand(problem.B, problem.T, problem.HV)
    d = erase_direction(q, k, b, arm, z) if d is None else d.to(ct)
    return q, k, lam, d, erase_vector(k, b, lam, d)


def token_scan(q, k, wv, g, a, d, scale, state, want_sd):
    """Token loop over ``[B, T, HV, *]`` tensors from ``state`` ``[B, HV, K, V]``."""
    outs, sds = [], []
    for t in range(q.shape[1]):
        s_bar = state * g[:, t].exp().unsqueeze(-1)
        if want_sd:
            sds.append(torch.einsum("bhkv,bhk->bhv", s_bar, d[:, t]))
        r = wv[:, t] - torch.einsum("bhkv,bhk->bhv", s_bar, a[:, t])
        state = s_bar + k[:, t].unsqueeze(-1) * r.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * scale))
    sd = torch.stack(sds, 1) if want_sd else None
    return torch.stack(outs, 1), state, sd


def qed_naive(q: Tensor, k: Tensor, v: Tensor, g: Tensor, b: Tensor, w: Tensor, lam: Tensor, *, arm: str = "full",
              z: Tensor | None = None, d: Tensor | None = None, scale: float | None = None,
              initial_state: Tensor | None = None, output_final_state: bool = False, return_probes: bool = False,
              use_qk_l2norm: bool = True, cu_seqlens: Tensor | None = None) -> QEDOutput:
    """Token-by-token QED forward (differentiable; the oracle for the kernels).

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (L2-normalised here when ``use_qk_l2norm``).
        v: ``[B, T, HV, V]`` values, ``HV`` a multiple of ``H`` (value head ``j`` reads
            query/key head ``j // (HV // H)``).
        g: natural-log decay, ``<= 0``: ``[B, T, HV, K]`` per channel, or ``[B, T, HV]`` one
            scalar per value head (Gated DeltaNet), broadcast over ``K``.
        b: erase gate, ``[B, T, HV, K]`` or ``[B, T, HV]`` (GDN's and KDA's ``beta``).
        w: write gate, ``[B, T, HV, V]`` or ``[B, T, HV]`` (``beta`` again in GDN and KDA).
        lam: ``[HV]`` per-head or ``[B, T, HV]`` per-token strength.
        arm: one of ``gdn2, nogate_noproj, nogate, full, rand, noproj``.
        z: ``[HV, K]`` unit vectors (one per value head), required for (and only for) ``arm="rand"``.
        d: optional ``[B, T, HV, K]`` direction that replaces the arm's (used as given).
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (N = B, or the number of packed sequences), in the
            state dtype.
        output_final_state: return the final ``[N, HV, K, V]`` state.
        return_probes: ``True`` to return ``{"rho": [B,T,HV], "d": [B,T,HV,K], "Sd": [B,T,HV,V],
            "e": [B,T,HV]}``, or a collection of those names for only them (``inputs.probe_request``).
        use_qk_l2norm: L2-normalise ``q`` and ``k`` inside the op (as fla's ``use_qk_l2norm_in_kernel``).
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (requires ``B == 1``).

    Returns:
        ``(o, final_state, probes)``: ``o`` ``[B, T, HV, V]`` in ``v``'s dtype; state and probes
        in float32 (float64 for float64 inputs); ``None`` for what was not asked.
    """
    return run_scan("qed_naive", token_scan, q, k, v, g, b, w, lam, arm=arm, z=z, d=d, scale=scale,
                    initial_state=initial_state, output_final_state=output_final_state,
                    return_probes=return_probes, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens)


def run_scan(op, scan, q, k, v, g, b, w, lam, *, arm, z, d, scale, initial_state, output_final_state,
             return_probes, use_qk_l2norm, cu_seqlens):
    """Check and prepare the inputs, then run ``scan`` once over the batch (or once per packed
    sequence) and assemble ``(o, final_state, probes)``; shared by the PyTorch ops.

    ``scan(q, k, wv, g, a, d, scale, state, want_sd) -> (o, state, Sd or None)`` works on
    ``[B, T, HV, *]`` tensors in the compute dtype from ``state`` ``[B, HV, K, V]``.
    """
    P = check_qed_inputs(op, q, k, v, g, b, w, lam, arm=arm, z=z, d=d, scale=scale,
                         initial_state=initial_state, cu_seqlens=cu_seqlens)
    want = probe_request(op, return_probes)
    ct = P.compute_dtype
    g, b, w = channel_gates(g, b, w, P)
    q, k, lam, d, a = prepare_qed(q, k, b, lam, arm, z, d, use_qk_l2norm, P)
    wv, g = w.to(ct) * v.to(ct), g.to(ct)
    if initial_state is None:
        initial_state = torch.zeros(P.N, P.HV, P.K, P.V, dtype=ct, device=q.device)
    if cu_seqlens is None:
        o, final_state, sd = scan(q, k, wv, g, a, d, P.scale, initial_state, "Sd" in want)
    else:
        parts = []
        for n, (_, bos, eos) in enumerate(P.seq_bounds):
            span = lambda x: x[:, bos:eos]  # noqa: E731
            parts.append(scan(span(q), span(k), span(wv), span(g), span(a), span(d), P.scale,
                              initial_state[n:n + 1], "Sd" in want))
        o = torch.cat([part[0] for part in parts], 1)
        final_state = torch.cat([part[1] for part in parts], 0)
        sd = torch.cat([part[2] for part in parts], 1) if "Sd" in want else None
    probes = None
    if want:
        every = {"rho": lambda: (q * k).sum(-1), "d": lambda: d, "Sd": lambda: sd, "e": lambda: 1 - (a * k).sum(-1)}
        probes = {name: every[name]() for name in want}
    return o.to(v.dtype), final_state if output_final_state else None, probes
