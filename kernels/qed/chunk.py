r"""Chunked (WY / UT-transform) Triton forward of QED for prefill: ``qed_chunk``.

The recurrence is the one written out at the top of ``naive.py``, with the residual
``r_t = w_t v_t - S_bar_t^T a_t`` and the state ``S`` (``K x V``) per sequence and value head.

Shapes (fla's GDN-2 convention): ``q, k`` ``[B, T, H, K]``; ``v, w`` ``[B, T, HV, V]``; ``g, b``
``[B, T, HV, K]``; ``lam`` ``[HV]`` or ``[B, T, HV]``; states ``[N, HV, K, V]`` (float32,
float64 for float64 inputs); ``o`` like ``v``; ``HV = m H``, value head ``j`` reads query/key
head ``j // m``. Any of ``g, b, w`` may be one scalar per token and value head, ``[B, T, HV]``
(Gated DeltaNet's gates; KDA's ``beta`` and write gate). A per-head ``b`` or ``w`` with a
per-channel ``g`` (KDA) is loaded one scalar per row and broadcast in registers
(``chunk_common.gate_tile``). A per-head ``g`` with a per-head ``b`` (Gated DeltaNet, Qwen3.5)
takes the scalar-gate path below; a per-head ``g`` with a per-channel ``b`` (no model's layout)
runs the per-channel kernels on ``g`` broadcast to its channels.

Chunk algorithm (chunks of ``BT = 64`` tokens; ``G`` = inclusive cumsum of ``g`` inside the
chunk, per channel; ``S0`` the chunk-start state)::

    S_bar_t = Diag(e^{G_t}) S0 + sum_{j<t} Diag(e^{G_t - G_j}) k_j r_j^T
    A_kk[t,j] = sum_c a_{t,c} e^{G_{t,c} - G_{j,c}} k_{j,c}              (j < t)
    R = (I + A_kk)^{-1} (W V - (a e^G) S0) = U - W S0                     (WY / UT transform)
    o_t  = (scale q_t e^{G_t})^T S0 + sum_{j<=t} A_qk[t,j] r_j
    Sd_t = (d_t e^{G_t})^T S0 + sum_{j<t} A_dk[t,j] r_j                   (probe S_bar_t^T d_t)
    S_next = Diag(e^{G_last}) S0 + sum_j (k_j e^{G_last - G_j}) r_j^T

This is fla's ``chunk_gdn2`` pipeline with GDN-2's erase vector ``b k`` replaced by
``a = b k + lam d``, in six launches, each behind one typed wrapper:

1. ``chunk_intra.chunk_prep_fwd``: per chunk, L2 norms, the per-row scalars, the probes
   ``rho, e, d``, ``G``, ``kg``, ``qg``, ``dg``, ``exp(G_last)``;
2. ``chunk_intra.chunk_scores_fwd``: per 16-row block, the score rows of ``A_kk, A_qk, A_dk``;
3. ``chunk_wy.chunk_inverse_fwd``: per chunk, ``(I + A_kk)^{-1}`` (block inverse);
4. ``chunk_wy.chunk_wy_fwd``: per chunk, ``W`` and ``U`` (fla's ``wy_fast.py``);
5. ``chunk_scan.chunk_state_fwd``: per sequence, value head and value block, the state
   recurrence (chunk-start states and residuals, as fla's ``chunk_delta_h``);
6. ``chunk_scan.chunk_output_fwd``: per chunk, value head and value block, the output and the
   probe ``Sd`` (as fla's ``chunk_o``).

Scalar-gate path (:func:`scalar_gate_forward`, ``g`` and ``b`` per head): with one decay per row
the within-chunk decay of a pair is a scalar and the erase vector of every arm is
``alpha_t k_hat_t + gamma_t x_t`` (``scalar_gram.py``), so the scores are Gram matrices of the
query/key head weighted per row. Five launches: ``scalar_gram.scalar_gram_fwd`` (per chunk and
query/key head: normalised ``q, k``, their Gram matrices once, per value head ``G``, ``alpha,
gamma`` and ``A_kk``), ``chunk_wy.chunk_inverse_fwd``, ``chunk_wy.scalar_wy_fwd`` (``a e^G``
rebuilt from ``k_hat``, ``x`` and the row scalars), ``chunk_scan.chunk_state_fwd`` (keys of the
query/key head, decay per row) and ``chunk_scan.scalar_output_fwd`` (``Q K^T`` formed there, as
fla's ``chunk_o``), or four where the scan forms the output itself (``chunk_scan.scan_forms_output``,
without ``Sd``). Nothing ``K``-wide is written per value head but ``W`` (and the probe ``d``).
With a scalar erase gate the direction of most arms lies in the span of ``q_hat_t`` and
``k_hat_t``, so the output stage reads the probe ``Sd`` off the residual, ``S_bar_t^T a_t = w_t v_t
- r_t``, and its own ``S_t^T q_hat_t`` (``chunk_scan.sd_form``); a sixth launch forms again, from
the direction rows, the chunks where that would divide by less than ``chunk_scan.SD_MIN_DENOMINATOR``.

Decays ``e^{G_t - G_j}`` are never formed as a product over long spans (see
``chunk_intra.py``), so any ``g <= 0`` is safe. With ``return_probes=False`` nothing
probe-related is computed or written (with probe names, on the scalar-gate path, ``d`` and
``Sd`` only when named). Every launch configuration is fixed by rule from the
sizes and dtypes (no autotuning), so the time of a call does not depend on earlier calls.

Precision: float32 arithmetic throughout; matrix products in tf32x3 for float32 inputs and in
tf32 (score rows, WY factors) / bf16 (state recurrence, as fla) for bf16 inputs; float64 inputs
run in float64 (ieee products; on a GPU only for K, V <= 128, else a ValueError).

Backward: ``chunk_bwd.py`` (autograd through ``qed_chunk`` when an input requires grad): the
forward keeps ``A_qk`` and ``(I + A_kk)^{-1}``; the backward reruns the prep, W/U and state-scan
launches at the forward's precision, then three backward launches.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
from torch.autograd.function import once_differentiable

from .arms import direction_flags
from .chunk_bwd import input_grads
from .chunk_common import ChunkLayout, chunk_layout, interpreting
from .chunk_intra import DirectionInputs, Prepared, chunk_prep_fwd, chunk_scores_fwd
from .chunk_scan import (SD_MIN_DENOMINATOR, chunk_output_fwd, chunk_state_fwd, multiprocessors, scalar_output_fwd,
                         scan_forms_output, sd_patched)
from .chunk_wy import WYFactors, chunk_inverse_fwd, chunk_wy_fwd, scalar_wy_fwd
from .inputs import QEDOutput, QEDProblem, check_qed_inputs, on_input_device, probe_request, selected_probes
from .scalar_gram import scalar_gram_fwd

Tensor = torch.Tensor


@dataclass(frozen=True)
class IntraChunk:
    """What the intra-chunk launches produce and the scans read: ``prep`` (row scalars, ``G``,
    ``kg, qg, a e^G, dg``, ``exp(G_last)``, probes), the score matrices ``aqk`` and (probes, else
    ``None``) ``adk``, ``ai = (I + A_kk)^{-1}`` (``[B, T, HV, BT]``, intermediate dtype) and ``wy``
    (``W, U``)."""

    prep: Prepared
    aqk: torch.Tensor
    adk: torch.Tensor | None
    ai: torch.Tensor
    wy: WYFactors


def chunk_precision(P: QEDProblem, q, k, v, b, w) -> tuple[torch.dtype, str]:
    """``(inter, prec)``: dtype of the intra buffers and ``tl.dot`` precision of the forward."""
    if P.compute_dtype == torch.float64:
        return torch.float64, "ieee"
    if all(x.dtype == torch.bfloat16 for x in (q, k, v)) and not interpreting():
        return torch.bfloat16, "tf32"  # (the interpreter's bf16 tl.dot is wrong: raw bits)
    if all(x.dtype == torch.float32 for x in (q, k, v, b, w)):
        return torch.float32, "tf32x3"  # float32-accurate products
    return torch.float32, "tf32"


def direction_inputs(P: QEDProblem, q, k, b, lam, arm, z, d, use_qk_l2norm) -> DirectionInputs:
    """The kernels' view of what builds the erase vector: contiguous tensors, ``lam`` in the state
    dtype, the arm as compile-time flags (a given ``d`` replaces the arm's direction)."""
    ct = P.compute_dtype
    return DirectionInputs(q=q.contiguous(), k=k.contiguous(), b=b.contiguous(), lam=lam.to(ct).contiguous(),
                           z=z.to(ct).contiguous() if (z is not None and d is None) else None,
                           d=d.contiguous() if d is not None else None,
                           flags=direction_flags(arm, d is not None), l2norm=bool(use_qk_l2norm))


def chunk_intra_fwd(x: DirectionInputs, v, w, g, *, scale: float, lay: ChunkLayout, inter: torch.dtype,
                    probes: bool) -> IntraChunk:
    """The four intra-chunk launches (prep, scores, inverse, W/U) on contiguous ``v, w, g``."""
    prep = chunk_prep_fwd(x, g, scale=scale, lay=lay, inter_dtype=inter, probes=probes)
    scores = chunk_scores_fwd(x, prep, scale=scale, lay=lay, inter_dtype=inter, probes=probes)
    ai = chunk_inverse_fwd(scores.akk, lay=lay, out_dtype=inter)
    wy = chunk_wy_fwd(prep.ag, v, w, ai, lay=lay)
    return IntraChunk(prep=prep, aqk=scores.aqk, adk=scores.adk, ai=ai, wy=wy)


def chunk_intra_recompute(x: DirectionInputs, v, w, g, aqk, ai, *, scale: float, lay: ChunkLayout,
                          inter: torch.dtype) -> IntraChunk:
    """The backward's :class:`IntraChunk` from the forward's saved ``aqk`` and ``ai``: only the
    cheap launches run again (prep, W/U), not the score rows and the block inverse (as fla's
    backward keeps ``A_qk`` and ``(I + A_kk)^{-1}`` and recomputes ``W, U, qg, kg``); the prep also
    writes ``scale q_hat, k_hat, a`` (state dtype), which the backward's scores kernel loads with
    ``G`` instead of rebuilding them."""
    prep = chunk_prep_fwd(x, g, scale=scale, lay=lay, inter_dtype=inter, probes=False, hats=True)
    return IntraChunk(prep=prep, aqk=aqk, adk=None, ai=ai, wy=chunk_wy_fwd(prep.ag, v, w, ai, lay=lay))


def _float64_guard(P: QEDProblem, fn):
    """Run ``fn()``; float64 launches that do not fit in shared memory become a ValueError."""
    try:
        return fn()
    except triton.runtime.errors.OutOfResources as err:
        if P.compute_dtype != torch.float64:
            raise
        raise ValueError(f"qed_chunk: float64 inputs with K={P.K} need more shared memory than this GPU "
                         f"has ({err}); use qed_naive (or float32 inputs) instead") from err


def run_scan(P: QEDProblem, lay: ChunkLayout, intra: IntraChunk, *, h0=None, ht=None):
    """The state scan on ``intra``'s buffers: ``(hs, r)``, the chunk-start states
    ``[NC, HV, K, V]`` and the residuals ``[B, T, HV, V]`` (both in the intermediate dtype);
    ``ht``, when given, receives the final states."""
    w = intra.wy.w
    hs = torch.empty(lay.NC, P.HV, P.K, P.V, device=w.device, dtype=w.dtype)
    r = torch.empty(P.B, P.T, P.HV, P.V, device=w.device, dtype=w.dtype)
    _float64_guard(P, lambda: chunk_state_fwd(lay, w=w, u=intra.wy.u, kg=intra.prep.kg, gl=intra.prep.gl, hs=hs,
                                              r=r, h0=h0, ht=ht, T=P.T, N=P.N))
    return hs, r


def scalar_gate_forward(P: QEDProblem, x: DirectionInputs, v, g, w, *, lay: ChunkLayout, inter: torch.dtype,
                        initial_state, output_final_state: bool, want: tuple[str, ...]):
    """The scalar-gate path (``g`` and ``b`` ``[B, T, HV]``), five launches (module docstring): the
    Gram stage (``scalar_gram``: normalised ``q, k`` and their Gram matrices once per query/key
    head; per value head ``G``, the per-row ``alpha, gamma`` of the erase vector and ``A_kk``), the
    block inverse, ``W, U``, the state scan and the output (formed in the scan where
    ``chunk_scan.scan_forms_output`` rules so and ``Sd`` is not asked for). ``want``: the probes
    asked for (``d`` and ``Sd`` are written only when named). Returns ``(o, final_state, probes)``."""
    dev, ct = v.device, P.compute_dtype
    gram, akk = scalar_gram_fwd(x, g.contiguous(), lay=lay, inter_dtype=inter, probes=bool(want),
                                direction="d" in want,
                                patch_below=SD_MIN_DENOMINATOR if "Sd" in want and sd_patched(x.flags) else None)
    ai = chunk_inverse_fwd(akk, lay=lay, out_dtype=inter)
    del akk  # each intermediate is freed once read, so that the probes' buffers fit in what fla holds
    v, w = v.contiguous(), w.contiguous()
    wy = scalar_wy_fwd(x, gram, v, w, ai, lay=lay)
    del ai
    ht = torch.empty(P.N, P.HV, P.K, P.V, device=dev, dtype=ct) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    o = torch.empty(P.B, P.T, P.HV, P.V, device=dev, dtype=v.dtype)
    q, k = gram.qk_rows(x)
    if "Sd" not in want and scan_forms_output(P.K, P.V, inter, scans=P.N * P.HV, sm_count=multiprocessors(dev)):
        sd = None  # the scan forms the output itself: no chunk-start states or residuals stored
        chunk_state_fwd(lay, w=wy.w, u=wy.u, kg=k, gl=None, gc=gram.gc, hs=None, h0=h0, ht=ht, q=q, rq=gram.rq,
                        o=o, scale=P.scale, T=P.T, N=P.N)
    else:  # the output stage reads the chunk-start states and residuals
        hs = torch.empty(lay.NC, P.HV, P.K, P.V, device=dev, dtype=inter)
        r = torch.empty(P.B, P.T, P.HV, P.V, device=dev, dtype=inter)
        chunk_state_fwd(lay, w=wy.w, u=wy.u, kg=k, gl=None, gc=gram.gc, hs=hs, r=r, h0=h0, ht=ht, T=P.T, N=P.N)
        del wy  # (fla's forward holds its A, w, u through the output stage)
        sd = torch.empty(P.B, P.T, P.HV, P.V, device=dev, dtype=ct) if "Sd" in want else None
        scalar_output_fwd(lay, x, gram, v=v, w=w, hs=hs, r=r, o=o, scale=P.scale, sd=sd)
    return o, ht, selected_probes({"rho": gram.rho, "d": gram.d, "Sd": sd, "e": gram.e}, want)


def _forward(P, q, k, v, g, b, w, lam, arm, z, d, initial_state, output_final_state, return_probes,
             use_qk_l2norm, cu_seqlens):
    """The forward launches (no autograd): ``(o, final_state, probes, intra)`` (``intra`` None on
    the scalar-gate path, which has no backward)."""
    want = probe_request("qed_chunk", return_probes)
    inter, prec = chunk_precision(P, q, k, v, b, w)
    lay = chunk_layout(P, cu_seqlens, q.device, prec)
    x = direction_inputs(P, q, k, b, lam, arm, z, d, use_qk_l2norm)
    if P.head_g and P.head_b:
        return (*_float64_guard(P, lambda: scalar_gate_forward(P, x, v, g, w, lay=lay, inter=inter,
                                                               initial_state=initial_state,
                                                               output_final_state=output_final_state, want=want)),
                None)
    if P.head_g:  # with a per-channel b (no model's layout): g broadcast to its channels
        g = g.unsqueeze(-1).expand(*g.shape, P.K)
    intra = chunk_intra_fwd(x, v.contiguous(), w.contiguous(), g.contiguous(), scale=P.scale, lay=lay,
                            inter=inter, probes=bool(want))
    ct, dev = P.compute_dtype, q.device
    o = torch.empty(P.B, P.T, P.HV, P.V, device=dev, dtype=v.dtype)
    ht = torch.empty(P.N, P.HV, P.K, P.V, device=dev, dtype=ct) if output_final_state else None
    sd = torch.empty(P.B, P.T, P.HV, P.V, device=dev, dtype=ct) if want else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    hs, r = run_scan(P, lay, intra, h0=h0, ht=ht)
    chunk_output_fwd(lay, qg=intra.prep.qg, aqk=intra.aqk, hs=hs, r=r, o=o,
                     dg=intra.prep.dg if want else None, adk=intra.adk, sd=sd)
    return o, ht, selected_probes({"rho": intra.prep.rho, "d": intra.prep.d, "Sd": sd, "e": intra.prep.e}, want), intra


class _QEDChunkFunction(torch.autograd.Function):
    """Autograd for ``qed_chunk``: Triton forward, Triton backward (``chunk_bwd.py``).

    Differentiable outputs: ``o`` and the final state; probes are observations (no gradient).
    Once differentiable (no double backward). Saved besides the inputs: the forward's ``A_qk``
    and ``(I + A_kk)^{-1}`` (two ``[B, T, HV, 64]`` tensors in the intermediate dtype).
    """

    @staticmethod
    def forward(ctx, opts, q, k, v, g, b, w, lam, d, initial_state):
        P, arm, z, output_final_state, return_probes, use_qk_l2norm, cu_seqlens = opts
        ctx.opts = opts
        ctx.set_materialize_grads(False)
        o, ht, probes, intra = _forward(P, q, k, v, g, b, w, lam, arm, z, d, initial_state, output_final_state,
                                        return_probes, use_qk_l2norm, cu_seqlens)
        ctx.save_for_backward(q, k, v, g, b, w, lam, d, initial_state, intra.aqk, intra.ai)
        return o, ht, probes

    @staticmethod
    @once_differentiable
    @on_input_device
    def backward(ctx, do, dht, _dprobes):
        P, arm, z, _, _, use_qk_l2norm, cu_seqlens = ctx.opts
        q, k, v, g, b, w, lam, d, h0, aqk, ai = ctx.saved_tensors
        inter, prec = chunk_precision(P, q, k, v, b, w)
        lay = chunk_layout(P, cu_seqlens, q.device, prec)
        x = direction_inputs(P, q, k, b, lam, arm, z, d, use_qk_l2norm)
        intra = chunk_intra_recompute(x, v.contiguous(), w.contiguous(), g.contiguous(), aqk, ai, scale=P.scale,
                                      lay=lay, inter=inter)
        states, r = run_scan(P, lay, intra, h0=h0.contiguous() if h0 is not None else None)
        return (None, *input_grads(ctx.needs_input_grad[1:], (q, k, v, g, b, w, lam, d, h0), x, P, lay, intra,
                                   states, r, do, dht))


def channel_gates_for_backward(P: QEDProblem, g, b, w):
    """``(P, g, b, w)`` with every per-head gate ``[B, T, HV]`` broadcast to its per-channel shape
    (an ``expand`` view; the kernels' inputs are then copied contiguous): the backward kernels
    take per-channel gates only, so a differentiable call with per-head gates runs the per-channel
    path, and autograd through the ``expand`` sums each gate's gradient over its channels."""
    if not (P.head_g or P.head_b or P.head_w):
        return P, g, b, w
    widen = lambda x, head, n: x.unsqueeze(-1).expand(*x.shape, n) if head else x  # noqa: E731
    return (dataclasses.replace(P, head_g=False, head_b=False, head_w=False), widen(g, P.head_g, P.K),
            widen(b, P.head_b, P.K), widen(w, P.head_w, P.V))


@on_input_device
def qed_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, b: Tensor, w: Tensor, lam: Tensor, *, arm: str = "full",
              z: Tensor | None = None, d: Tensor | None = None, scale: float | None = None,
              initial_state: Tensor | None = None, output_final_state: bool = False, return_probes: bool = False,
              use_qk_l2norm: bool = True, cu_seqlens: Tensor | None = None) -> QEDOutput:
    """Chunked Triton QED op (prefill); same arguments, results and dtypes as ``qed_naive``.

    Requires CUDA tensors (or ``TRITON_INTERPRET=1`` on CPU); ``K, V <= 256`` (``<= 128`` for
    float64 on a GPU).

    Args:
        q, k: ``[B, T, H, K]`` queries and keys.
        v: ``[B, T, HV, V]`` values, ``HV = m H`` (value head ``j`` reads query/key head ``j // m``).
        g: log-decay ``[B, T, HV, K]``, or ``[B, T, HV]`` (one scalar per value head).
        b: erase gate ``[B, T, HV, K]`` or ``[B, T, HV]``.
        w: write gate ``[B, T, HV, V]`` or ``[B, T, HV]``.
        lam: strength ``[HV]`` or ``[B, T, HV]``.
        arm, z, d, scale, initial_state, output_final_state, return_probes, use_qk_l2norm,
            cu_seqlens: as ``qed_naive``.

    Returns:
        ``(o, final_state, probes)``: ``o`` ``[B, T, HV, V]`` in ``v``'s dtype, the final state
        ``[N, HV, K, V]`` (or ``None``) and, with ``return_probes``, ``{"rho", "d", "Sd", "e"}`` or the
        named ones (per value head) in the state dtype (float32; float64 for float64 inputs).

    Differentiable (Triton backward, ``chunk_bwd.py``) when grad mode is on and any of ``q, k,
    v, g, b, w, lam, d, initial_state`` requires grad: gradients of ``o`` and the final state
    reach all of them (``lam`` per head or per token, ``d`` when given; the gradients of ``q, k``
    sum over each group). ``z`` is a fixed buffer (no gradient); probes are forward-only
    observations (no gradient flows through them). The backward takes per-channel gates: a
    differentiable call with per-head gates runs the per-channel path on broadcast copies
    (:func:`channel_gates_for_backward`); without gradients they are read as scalars.
    """
    P = check_qed_inputs("qed_chunk", q, k, v, g, b, w, lam, arm=arm, z=z, d=d, scale=scale,
                         initial_state=initial_state, cu_seqlens=cu_seqlens)
    K, V = P.K, P.V
    if K > 256 or V > 256:
        raise ValueError(f"qed_chunk: K and V must be at most 256, got K={K}, V={V}")
    if P.compute_dtype == torch.float64 and q.is_cuda and max(K, V) > 128:
        raise ValueError(f"qed_chunk: float64 inputs on a GPU support K, V <= 128 (the [64, K] float64 "
                         f"tiles of the scan kernel need more shared memory), got K={K}, V={V}; "
                         "use qed_naive or float32 inputs")
    diff = (q, k, v, g, b, w, lam, d, initial_state)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in diff):
        P, g, b, w = channel_gates_for_backward(P, g, b, w)
        opts = (P, arm, z, output_final_state, return_probes, use_qk_l2norm, cu_seqlens)
        return _QEDChunkFunction.apply(opts, q, k, v, g, b, w, lam, d, initial_state)
    return _forward(P, q, k, v, g, b, w, lam, arm, z, d, initial_state, output_final_state, return_probes,
                    use_qk_l2norm, cu_seqlens)[:3]
