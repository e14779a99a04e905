r"""Backward of ``qed_chunk``: gradients of ``o`` and the final state w.r.t. every input.

Split in two (``a`` the erase vector, ``wv = w * v``)::

    core (Triton):  (dO, dS_T) -> d q_hat, d k_hat, d a, d wv, d g, d S_0
    map (autograd): d q_hat, d k_hat, d a, d wv -> dq, dk, dv, db, dw, dlam (and dd)

The core runs, after recomputing the forward's intra-chunk pieces (``chunk_intra``, in the state
dtype) and the chunk-start states (``chunk_scan`` with ``HS``): ``chunk_bwd_scan`` (reverse
scan over chunks: residuals, their gradient and the chunk-end state gradients) and
``chunk_bwd_intra`` (per chunk: the products with the states, the UT-transform and
score-matrix gradients, the decay gradient). The map is PyTorch autograd through
``naive.prepare_qed`` (L2 norms, the arm's direction ``d``, ``a = b k + lam d``) and ``w * v``:
small elementwise and row-reduction work, the same code the reference runs forward.

Transient memory in the state dtype, besides the recomputed intra buffers: two
``[NC, H, K, V]`` state sets, four ``[B, T, H, V]``, nine ``[B, T, H, K]`` and one
``[B, T, H, 64]`` tensors.
"""
from __future__ import annotations

import torch
import triton

from .chunk_bwd_intra import qed_intra_bwd_kernel
from .chunk_bwd_scan import qed_dstate_kernel
from .naive import prepare_qed

DSTATE_CONFIG = {"BV": 32, "num_warps": 8}
"""Reverse-scan launch: ptxas (sm_90, float32 state, tf32x3, K=V=128) spills 2.4 KB per thread
at these settings vs 6.0 KB at BV=64 / 4 warps (``bench/chunk_aot.py bwd``). The whole forward +
backward takes 57.6 ms at the benchmark shape on an H200 (docs/BENCHMARKS.md); the kernels
have not been profiled one by one."""
INTRA_BWD_CONFIG = {"BKS": 32, "BVS": 32, "num_warps": 8}


def core_backward(q_hat, k_hat, a, g, do, dht, bufs, states, lay, scale):
    """Gradients w.r.t. the effective per-token inputs of one ``qed_chunk`` call.

    Args:
        q_hat, k_hat, a: ``[B, T, H, K]`` (state dtype) normalised query, key and erase vector.
        g: ``[B, T, H, K]`` log-decay as given to the forward.
        do: ``[B, T, H, V]`` gradient of ``o`` (or ``None``); dht: ``[N, H, K, V]`` or ``None``.
        bufs: the intra buffers ``W, U, KG, QG, AQK, GL, AKK`` (``AKK`` holds ``(I + A_kk)^{-1}``)
            in the state dtype; states: ``[NC, H, K, V]`` chunk-start states.
        lay: the call's layout (``chunk.Layout``); scale: the output scale.

    Returns:
        ``(dq_hat, dk_hat, da, dwv, dg, dh0)`` in the state dtype.
    """
    B, T, H, K, V, N = lay.P.B, lay.P.T, lay.P.H, lay.P.K, lay.P.V, lay.P.N
    ct, dev = states.dtype, states.device
    prec = lay.prec
    BK = triton.next_power_of_2(K)
    BV = min(DSTATE_CONFIG["BV"], triton.next_power_of_2(V))
    do = torch.zeros(B, T, H, V, device=dev, dtype=ct) if do is None else do.to(ct).contiguous()
    du, rs = (torch.empty(B, T, H, V, device=dev, dtype=ct) for _ in range(2))
    dh = torch.empty_like(states)
    dh0 = torch.empty(N, H, K, V, device=dev, dtype=ct)
    qed_dstate_kernel[(triton.cdiv(V, BV), N * H)](
        bufs["W"], bufs["U"], bufs["KG"], bufs["QG"], bufs["AQK"], bufs["GL"], states, do,
        dht.contiguous() if dht is not None else dh0, du, rs, dh, dh0, lay.cu, lay.chunk_offsets, T,
        H=H, K=K, V=V, BT=lay.BT, BK=BK, BV=BV, USE_DHT=dht is not None, IS_VARLEN=lay.cu is not None,
        DT=lay.DT, PREC=prec, WHILE_LOOP=lay.interpreting, num_warps=DSTATE_CONFIG["num_warps"], num_stages=1,
    )

    dq, dk, da, dg, dqg, dkg = (torch.empty(B, T, H, K, device=dev, dtype=ct) for _ in range(6))
    dgl = torch.empty(lay.NC, H, K, device=dev, dtype=ct)
    daqk = torch.empty(B, T, H, lay.BT, device=dev, dtype=ct)
    dwv = torch.empty(B, T, H, V, device=dev, dtype=ct)
    BKS = min(INTRA_BWD_CONFIG["BKS"], BK)
    BVS = min(INTRA_BWD_CONFIG["BVS"], triton.next_power_of_2(V))
    qed_intra_bwd_kernel[lay.grid](
        q_hat.contiguous(), k_hat.contiguous(), a.contiguous(), g.contiguous(), bufs["AKK"], bufs["W"],
        bufs["U"], states, do, du, rs, dh, dqg, dkg, dgl, daqk, dq, dk, da, dg, dwv,
        lay.cu, lay.chunk_indices, T, scale,
        H=H, K=K, V=V, BT=lay.BT, BC=16, BKS=BKS, BVS=BVS, NK=triton.cdiv(K, BKS), NV=triton.cdiv(V, BVS),
        IS_VARLEN=lay.cu is not None, DT=lay.DT, PREC=prec, num_warps=INTRA_BWD_CONFIG["num_warps"], num_stages=1,
    )
    return dq, dk, da, dwv, dg, dh0


def input_grads(needs, saved, arm, z, use_qk_l2norm, P, lay, bufs, states, do, dht):
    """Gradients for ``(q, k, v, g, b, w, lam, d, initial_state)`` (``None`` where not needed).

    ``needs``: which of them require a gradient; ``saved``: the tensors themselves; ``P``: the
    call's ``QEDProblem``; ``lay, bufs, states``: as :func:`core_backward`; ``do, dht``: the
    incoming gradients of ``o`` and the final state (either may be ``None``).
    """
    leaves = [x.detach().requires_grad_(n) if x is not None else None for x, n in zip(saved, needs)]
    q, k, v, g, b, w, lam, d, _ = leaves
    with torch.enable_grad():
        q_hat, k_hat, _, _, a = prepare_qed(q, k, b, lam, arm, z, d, use_qk_l2norm, P)
        wv = w.to(P.compute_dtype) * v.to(P.compute_dtype)
    dq_hat, dk_hat, da, dwv, dg, dh0 = core_backward(q_hat.detach(), k_hat.detach(), a.detach(), saved[3],
                                                     do, dht, bufs, states, lay, P.scale)
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
