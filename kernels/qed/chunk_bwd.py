r"""Backward of ``qed_chunk``: gradients of ``o`` and the final state w.r.t. every input.

Organised as fla's GDN-2 chunk backward. It takes the forward's intra-chunk pieces
(``chunk.IntraChunk``: row scalars, ``G``, ``kg, qg, a e^G``, ``scale q_hat, k_hat, a``,
``A_qk``, ``(I + A_kk)^{-1}``, ``W, U``; ``A_qk`` and the inverse kept from the forward, the rest
recomputed), the chunk-start states and the residuals ``R`` (the recomputed forward scan), then
runs five launches behind four typed wrappers:

1. ``chunk_bwd_scan.chunk_bwd_state``: per sequence, value head and value block, the reverse
   state scan carrying only the ``[K, BV]`` state gradient: the chunk-end state gradients
   ``dS1``, the residual gradient ``dR = A_qk^T dO + kg dS1`` and the initial-state gradient;
2. ``chunk_bwd_intra.chunk_bwd_wy``: per chunk, every product over the value axis or all keys
   (``d(wv) = Tm^T dR`` written as ``dv, dw``, ``dA_qk = dO R^T``, ``dqg = dO S0^T``,
   ``dkg = R dS1^T``, the WY gradients ``d(a e^G)`` and ``dA_kk``);
3. ``chunk_bwd_intra.chunk_bwd_scores``: per 16-row block of a chunk, value head and key slice,
   the score-matrix and decay terms and the elementwise terms (the gradients of ``q_hat, k_hat,
   a`` per value head, and ``dG`` per row); then per chunk and key slice the reverse cumsum of
   ``dG`` plus ``dG_last``: the gradient of ``g``;
4. ``chunk_bwd_prep.chunk_prep_bwd``: per chunk and query/key head, the L2-norm, projection and
   gate backward from ``q_hat, k_hat, a`` to ``q, k, b, lam, d`` (``q, k`` summed over each
   group of value heads).

Precision: the products take their operands in the forward's intermediate dtype (bf16 for
bf16 inputs, as fla's backward) and accumulate in the state dtype; every gradient is computed
in the state dtype and returned in its input's dtype. Transient memory besides the forward's
pieces: one ``[NC, HV, K, V]`` set of state gradients (intermediate dtype), three
``[B, T, HV, V]``, up to twelve ``[B, T, HV or H, K]``, two ``[B, T, HV, 64]`` and one
``[NC, HV, 4, K]`` tensors in the state dtype; the backward's prep also writes ``G, scale q_hat,
k_hat, a`` (four ``[B, T, HV, K]`` in the state dtype) that the forward's does not.
"""
from __future__ import annotations

import torch

from .chunk_bwd_intra import chunk_bwd_scores, chunk_bwd_wy
from .chunk_bwd_prep import chunk_prep_bwd
from .chunk_bwd_scan import chunk_bwd_state
from .chunk_intra import DirectionInputs


def core_backward(g, v, w, do, dht, intra, states, r, lay, P):
    """Gradients w.r.t. the effective per-token inputs of one ``qed_chunk`` call.

    Args:
        g: ``[B, T, HV, K]`` log-decay as given to the forward; v, w: values and write gate
            ``[B, T, HV, V]`` (contiguous).
        do: ``[B, T, HV, V]`` gradient of ``o`` (or ``None``); dht: ``[N, HV, K, V]`` or ``None``.
        intra: the call's ``chunk.IntraChunk`` (from ``chunk.chunk_intra_recompute``: its prep holds
            ``G, scale q_hat, k_hat, a``); states: ``[NC, HV, K, V]`` chunk-start states and
            r: ``[B, T, HV, V]`` residuals (both in the intermediate dtype).
        lay: the call's ``chunk_common.ChunkLayout``; P: its ``inputs.QEDProblem``.

    Returns:
        ``(dq_hat, dk_hat, da, dv, dw, dg, dh0)`` per value head: ``dv, dw, dg`` in the dtypes of
        ``v, w, g``, the others in the state dtype.
    """
    ct, dev = lay.state_dtype, states.device
    do = torch.zeros(P.B, P.T, P.HV, P.V, device=dev, dtype=r.dtype) if do is None else do.contiguous()
    dh = torch.empty_like(states)
    dr = torch.empty(P.B, P.T, P.HV, P.V, device=dev, dtype=ct)
    dh0 = torch.empty(P.N, P.HV, P.K, P.V, device=dev, dtype=ct)
    wy, prep = intra.wy, intra.prep
    chunk_bwd_state(lay, w=wy.w, kg=prep.kg, qg=prep.qg, aqk=intra.aqk, gl=prep.gl, do=do,
                    dht=dht.contiguous() if dht is not None else None, dh=dh, dr=dr, dh0=dh0, T=P.T, N=P.N)
    grads = chunk_bwd_wy(lay, ai=intra.ai, w=wy.w, u=wy.u, r=r, hs=states, dh=dh, do=do, dr=dr, v=v, w_gate=w)
    dq, dk, da, dg = chunk_bwd_scores(lay, prep, g=g, wy_grads=grads, scale=P.scale)
    return dq, dk, da, grads.dv, grads.dw, dg, dh0


def input_grads(needs, saved, x: DirectionInputs, P, lay, intra, states, r, do, dht):
    """Gradients for ``(q, k, v, g, b, w, lam, d, initial_state)`` (``None`` where not needed),
    each in its input's dtype.

    ``needs``: which of them require a gradient; ``saved``: the tensors themselves; ``x``: the
    call's ``chunk_intra.DirectionInputs``; ``P``: its ``QEDProblem``; ``lay, intra, states, r``:
    as :func:`core_backward`; ``do, dht``: the incoming gradients of ``o`` and the final state
    (either may be ``None``). ``chunk_bwd_prep`` maps the per-value-head gradients of ``q_hat,
    k_hat, a`` back to ``q, k, b, lam, d`` (summing ``q, k`` over each group of value heads).
    """
    _, _, v, g, _, w, lam, _, _ = saved
    dq_hat, dk_hat, da, dv, dw, dg, dh0 = core_backward(g.contiguous(), v.contiguous(), w.contiguous(), do, dht,
                                                        intra, states, r, lay, P)
    prep = intra.prep
    dq, dk, db, dd, dlam = chunk_prep_bwd(x, lay, rq=prep.rq, rk=prep.rk, cp=prep.cp, gq=dq_hat, gk=dk_hat, ga=da)
    if lam.dim() == 1:
        dlam = dlam.sum((0, 1))
    grads = (dq, dk, dv, dg, db, dw, dlam, dd, dh0)
    return tuple(gr.to(t.dtype) if (n and gr is not None) else None for gr, t, n in zip(grads, saved, needs))
