r"""Backward of ``qed_chunk``: gradients of ``o`` and the final state w.r.t. every input.

Split in two (``a`` the erase vector, ``wv = w * v``)::

    core (Triton):  (dO, dS_T) -> d q_hat, d k_hat, d a, d wv, d g, d S_0
    map (autograd): d q_hat, d k_hat, d a, d wv -> dq, dk, dv, db, dw, dlam (and dd)

The core runs, after recomputing the forward's intra-chunk pieces (``chunk_intra``, in the state
dtype) and the chunk-start states (``chunk_scan`` with ``HS``): ``chunk_bwd_scan`` (reverse
scan over chunks: residuals, their gradient and the chunk-end state gradients) and
``chunk_bwd_intra`` (per chunk: the products with the states and the UT-transform gradient;
then per chunk and key slice: the score-matrix and decay gradients). The map is PyTorch
autograd through ``naive.prepare_qed`` (L2 norms, the arm's direction ``d``, ``a = b k + lam d``) and ``w * v``:
small elementwise and row-reduction work, the same code the reference runs forward.

Grouped value heads: the core works per value head (``q_hat, k_hat`` expanded to ``HV`` heads
by ``prepare_qed``); the map's autograd sums their gradients over each group.

Transient memory in the state dtype, besides the recomputed intra buffers: two
``[NC, HV, K, V]`` state sets, four ``[B, T, HV, V]``, nine ``[B, T, HV, K]`` and one
``[B, T, HV, 64]`` tensors.
"""
from __future__ import annotations

import torch
import triton

from .chunk_bwd_intra import qed_bwd_scores_kernel, qed_bwd_wy_kernel
from .chunk_bwd_scan import qed_dstate_kernel
from .chunk_common import BC, BT
from .naive import prepare_qed

DSTATE_CONFIG = {"BV": 32, "num_warps": 8}
"""Reverse-scan launch, fixed by rule: ptxas (sm_90, float32 state, tf32x3, K=V=128) spills
less at these settings than at BV=64 / 4 warps (``bench/chunk_aot.py bwd``; docs/BENCHMARKS.md)."""
INTRA_BWD_CONFIG = {"BKS": 32, "BVS": 16, "wy_warps": 8, "scores_warps": 8}
"""Slices and warps of the two intra-chunk backward kernels (by rule; ptxas figures in
docs/BENCHMARKS.md)."""


def core_backward(q_hat, k_hat, a, g, do, dht, intra, states, lay, P):
    """Gradients w.r.t. the effective per-token inputs of one ``qed_chunk`` call.

    Args:
        q_hat, k_hat, a: ``[B, T, HV, K]`` (state dtype) normalised query and key (expanded to the
            value heads) and erase vector.
        g: ``[B, T, HV, K]`` log-decay as given to the forward.
        do: ``[B, T, HV, V]`` gradient of ``o`` (or ``None``); dht: ``[N, HV, K, V]`` or ``None``.
        intra: the recomputed ``chunk.IntraChunk`` (state dtype); states: ``[NC, HV, K, V]``
            chunk-start states.
        lay: the call's ``chunk_common.ChunkLayout``; P: its ``inputs.QEDProblem``.

    Returns:
        ``(dq_hat, dk_hat, da, dwv, dg, dh0)`` in the state dtype, per value head.
    """
    B, T, HV, K, V, N = P.B, P.T, P.HV, P.K, P.V, P.N
    ct, dev = states.dtype, states.device
    prec = lay.prec
    BK = triton.next_power_of_2(K)
    BV = min(DSTATE_CONFIG["BV"], triton.next_power_of_2(V))
    do = torch.zeros(B, T, HV, V, device=dev, dtype=ct) if do is None else do.to(ct).contiguous()
    du, rs = (torch.empty(B, T, HV, V, device=dev, dtype=ct) for _ in range(2))
    dh = torch.empty_like(states)
    dh0 = torch.empty(N, HV, K, V, device=dev, dtype=ct)
    wy, prep = intra.wy, intra.prep
    qed_dstate_kernel[(triton.cdiv(V, BV), N * HV)](
        W=wy.w, U=wy.u, KG=prep.kg, QG=prep.qg, AQK=intra.scores.aqk, GL=prep.gl, HS=states, DO=do,
        DHT=dht.contiguous() if dht is not None else None, DU=du, RS=rs, DH=dh, DH0=dh0,
        cu_seqlens=lay.cu_seqlens, chunk_offsets=lay.chunk_offsets, T=T, H=HV, K=K, V=V, BT=BT, BK=BK, BV=BV,
        DT=lay.DT, PREC=prec, WHILE_LOOP=lay.interpreting, num_warps=DSTATE_CONFIG["num_warps"], num_stages=1,
    )

    dq, dk, da, dg, dqg, dkg = (torch.empty(B, T, HV, K, device=dev, dtype=ct) for _ in range(6))
    dgl = torch.empty(lay.NC, HV, K, device=dev, dtype=ct)
    daqk = torch.empty(B, T, HV, BT, device=dev, dtype=ct)
    dwv = torch.empty(B, T, HV, V, device=dev, dtype=ct)
    BKS = min(INTRA_BWD_CONFIG["BKS"], BK)
    BVS = min(INTRA_BWD_CONFIG["BVS"], triton.next_power_of_2(V))
    NK = triton.cdiv(K, BKS)
    qed_bwd_wy_kernel[lay.grid](
        AKK=intra.ai, W=wy.w, U=wy.u, HS=states, DO=do, DU=du, RS=rs, DH=dh, DQG=dqg, DKG=dkg, DGL=dgl,
        DAQK=daqk, DG=dg, DWV=dwv, cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T,
        H=HV, K=K, V=V, BT=BT, BKS=BKS, BVS=BVS, NK=NK, NV=triton.cdiv(V, BVS),
        DT=lay.DT, PREC=prec, num_warps=INTRA_BWD_CONFIG["wy_warps"],
        num_stages=1,
    )
    qed_bwd_scores_kernel[(*lay.grid, NK)](
        QH=q_hat.contiguous(), KH=k_hat.contiguous(), A=a.contiguous(), g=g.contiguous(), DAKK=intra.ai,
        DQG=dqg, DKG=dkg, DGL=dgl, DAQK=daqk, DQ=dq, DK=dk, DA=da, DG=dg,
        cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T, scale=P.scale,
        H=HV, K=K, BT=BT, BC=BC, BKS=BKS, DT=lay.DT, PREC=prec,
        num_warps=INTRA_BWD_CONFIG["scores_warps"], num_stages=1,
    )
    return dq, dk, da, dwv, dg, dh0


def input_grads(needs, saved, arm, z, use_qk_l2norm, P, lay, intra, states, do, dht):
    """Gradients for ``(q, k, v, g, b, w, lam, d, initial_state)`` (``None`` where not needed).

    ``needs``: which of them require a gradient; ``saved``: the tensors themselves; ``P``: the
    call's ``QEDProblem``; ``lay, intra, states``: as :func:`core_backward`; ``do, dht``: the
    incoming gradients of ``o`` and the final state (either may be ``None``). The map from the
    per-value-head ``q_hat, k_hat`` back to ``q, k`` (autograd through ``prepare_qed``) sums the
    gradients over each group of value heads.
    """
    leaves = [x.detach().requires_grad_(n) if x is not None else None for x, n in zip(saved, needs)]
    q, k, v, g, b, w, lam, d, _ = leaves
    with torch.enable_grad():
        q_hat, k_hat, _, _, a = prepare_qed(q, k, b, lam, arm, z, d, use_qk_l2norm, P)
        wv = w.to(P.compute_dtype) * v.to(P.compute_dtype)
    dq_hat, dk_hat, da, dwv, dg, dh0 = core_backward(q_hat.detach(), k_hat.detach(), a.detach(), saved[3],
                                                     do, dht, intra, states, lay, P)
    pairs = [(t, dt) for t, dt in ((q_hat, dq_hat), (k_hat, dk_hat), (a, da), (wv, dwv)) if t.requires_grad]
    mapped = {}
    wanted = [i for i in (0, 1, 2, 4, 5, 6, 7) if needs[i]]
    if wanted and pairs:
        outs, grads = zip(*pairs)
        found = torch.autograd.grad(outs, [leaves[i] for i in wanted], grads, allow_unused=True)
        mapped = dict(zip(wanted, found))
    result = [mapped.get(i) for i in range(9)]
    result[3] = dg.to(g.dtype) if needs[3] else None
    result[8] = dh0 if needs[8] else None
    return tuple(result)
