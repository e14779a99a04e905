r"""Chunked (WY / UT-transform) Triton forward of QED for prefill: ``qed_chunk``.

The recurrence is the one written out at the top of ``naive.py``, with the residual
``r_t = w_t v_t - S_bar_t^T a_t`` and the state ``S`` (``K x V``) per sequence and head.

Shapes: ``q, k, g, b`` ``[B, T, H, K]``; ``v, w`` ``[B, T, H, V]``; ``lam`` ``[H]`` or
``[B, T, H]``; states ``[N, H, K, V]`` (float32, float64 for float64 inputs); ``o`` like ``v``.

Chunk algorithm (chunks of ``BT = 64`` tokens; ``G`` = inclusive cumsum of ``g`` inside the
chunk, per channel; ``S0`` the chunk-start state)::

    S_bar_t = Diag(e^{G_t}) S0 + sum_{j<t} Diag(e^{G_t - G_j}) k_j r_j^T
    A_kk[t,j] = sum_c a_{t,c} e^{G_{t,c} - G_{j,c}} k_{j,c}              (j < t)
    R = (I + A_kk)^{-1} (W V - (a e^G) S0) = U - W S0                     (WY / UT transform)
    o_t  = (scale q_t e^{G_t})^T S0 + sum_{j<=t} A_qk[t,j] r_j
    Sd_t = (d_t e^{G_t})^T S0 + sum_{j<t} A_dk[t,j] r_j                   (probe S_bar_t^T d_t)
    S_next = Diag(e^{G_last}) S0 + sum_j (k_j e^{G_last - G_j}) r_j^T

Three launches: ``chunk_intra.qed_prep_kernel`` (per chunk: L2 norms, the per-row scalars, the
probes rho / e / d, ``G`` to a scratch, ``kg``, ``qg``, ``dg``, ``exp(G_last)``),
``chunk_intra.qed_solve_kernel`` (per chunk: the score blocks, ``(I + A_kk)^{-1}``, ``W``, ``U``;
rows of ``G`` and of ``A_kk`` are read from memory instead of being pulled out of register tiles)
and ``chunk_scan.qed_scan_kernel`` (per sequence, head and value block: the state recurrence
fused with the output and the probe ``Sd``). At the benchmark shape on an H200 (B=8, T=4096,
H=16, K=V=128, bf16; docs/BENCHMARKS.md) they take 0.62 / 1.85 / 0.45 ms, 2.91 ms in all against
4.79 ms for the earlier single intra kernel, which walked ~300 dependent cross-warp reductions
per program.
Decays ``e^{G_t - G_j}`` are never formed as a product over long spans: off-diagonal 16-row
sub-blocks use a reference point between ``t`` and ``j`` (both factors <= 1) and diagonal
sub-blocks fall back to exact per-element exponentials when their decay span exceeds 30 nats, so
any ``g <= 0`` (also ``-inf``-free large negatives) is safe.
With ``return_probes=False`` nothing probe-related is computed or written (``tl.constexpr``).

Precision: float32 arithmetic throughout; matrix products in tf32x3 for float32 inputs and in
tf32 (score rows, WY factors) / bf16 (state recurrence, as fla) for bf16 inputs; float64 inputs
run in float64 (ieee products; on a GPU only for K, V <= 128, else a ValueError).

Backward: ``chunk_bwd.py`` (autograd through ``qed_chunk`` when an input requires grad).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .chunk_bwd import input_grads
from .chunk_intra import ARM_CODES, ARM_GIVEN_D, SPAN_MAX, qed_prep_kernel, qed_solve_kernel
from .chunk_scan import qed_scan_kernel
from .inputs import QEDProblem, check_qed_inputs, on_input_device

BT = 64
BC = 16
INTRA_CONFIG = {"BKS": 32, "prep_BKS": 16, "prep_warps": 4}
"""Key slices of ``qed_solve_kernel`` (autotuned over 8 / 4 warps, keyed on K, V, BT and the probe
switch; 2 warps spill 1.2-1.8 KB per thread) and of ``qed_prep_kernel``, with its warps: ptxas
(sm_90, bf16, K=V=128, ``bench/chunk_aot.py``) gives the prep kernel 91 / 140 registers (probes
off / on) and no spills at 16 x 4 warps, 255 and spills at 32 x 4."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tl_dtype(dt: torch.dtype):
    return {torch.float32: tl.float32, torch.float64: tl.float64}[dt]


@dataclass(frozen=True)
class Layout:
    """Chunk bookkeeping of one call, shared by the forward and backward launches.

    ``P`` the validated call (sizes); ``NC`` chunks in all; ``grid`` the per-chunk launch grid; with ``cu_seqlens``, ``cu``,
    ``chunk_indices`` (``[NC, 2]``: sequence, chunk within it) and ``chunk_offsets`` (first chunk
    of each sequence), else ``None``. ``DT`` is the state dtype as a Triton type, ``prec`` the
    ``tl.dot`` input precision.
    """

    P: QEDProblem
    NC: int
    BT: int
    grid: tuple
    cu: torch.Tensor | None
    chunk_indices: torch.Tensor | None
    chunk_offsets: torch.Tensor | None
    DT: object
    prec: str
    interpreting: bool


def _layout(P, cu_seqlens, dev, prec) -> Layout:
    if cu_seqlens is not None:
        idx, offs = [], []
        for n, (_, bos, eos) in enumerate(P.seq_bounds):
            offs.append(len(idx))
            idx.extend((n, i) for i in range(triton.cdiv(eos - bos, BT)))
        chunk_indices = torch.tensor(idx, dtype=torch.int32, device=dev)
        chunk_offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
        cu = cu_seqlens.to(device=dev, dtype=torch.int32).contiguous()
        NC, grid = len(idx), (len(idx), P.H)
    else:
        chunk_indices = chunk_offsets = cu = None
        NC, grid = P.B * triton.cdiv(P.T, BT), (triton.cdiv(P.T, BT), P.B * P.H)
    return Layout(P=P, NC=NC, BT=BT, grid=grid, cu=cu,
                  chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
                  DT=_tl_dtype(P.compute_dtype), prec=prec, interpreting=_interpreting())


def _precision(P, q, k, v, b, w):
    """``(inter, prec)``: dtype of the intra buffers and ``tl.dot`` precision of the forward."""
    ct = P.compute_dtype
    if ct == torch.float64:
        inter = torch.float64
    elif (q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16 and v.dtype == torch.bfloat16
          and not _interpreting()):  # the interpreter's bf16 tl.dot is wrong (raw bits)
        inter = torch.bfloat16
    else:
        inter = torch.float32
    # float64: ieee; float32 inputs: tf32x3 (float32-accurate products); bf16/fp16: tf32.
    if ct == torch.float64:
        return inter, "ieee"
    if inter == torch.float32 and all(x.dtype == torch.float32 for x in (q, k, v, b, w)):
        return inter, "tf32x3"
    return inter, "tf32"


def _intra(lay, P, x, inter, probes):
    """Launch the two intra kernels on the inputs ``x`` (dict, as ``_forward`` prepares them).

    Returns the buffers ``W, U, KG, QG, AQK, GL, AKK`` (``AKK`` ends as ``(I + A_kk)^{-1}``), the
    scratch ``GC, RQ, RK, CP`` and, with ``probes``, ``DG, ADK, rho, eig, dpr``.
    """
    B, T, H, K, V, dev, ct = P.B, P.T, P.H, P.K, P.V, x["q"].device, P.compute_dtype
    bk = lambda dt: torch.empty(B, T, H, K, device=dev, dtype=dt)  # noqa: E731
    row = lambda: torch.empty(B, T, H, device=dev, dtype=ct)  # noqa: E731
    bufs = {"W": bk(inter), "KG": bk(inter), "QG": bk(inter), "GC": bk(ct), "RQ": row(), "RK": row(), "CP": row(),
            "U": torch.empty(B, T, H, V, device=dev, dtype=inter),
            "AQK": torch.empty(B, T, H, BT, device=dev, dtype=inter),
            "GL": torch.empty(lay.NC, H, K, device=dev, dtype=ct),
            "AKK": torch.empty(B, T, H, BT, device=dev, dtype=ct)}  # scratch: A_kk, then its inverse
    if probes:
        bufs.update(DG=bk(inter), ADK=torch.empty_like(bufs["AQK"]), dpr=bk(ct), rho=row(), eig=row())
    opt = lambda name, fallback: bufs[name] if probes else bufs[fallback]  # noqa: E731
    BKS = min(INTRA_CONFIG["BKS"], triton.next_power_of_2(K))
    BVS = min(64, triton.next_power_of_2(V))
    PBKS = min(INTRA_CONFIG["prep_BKS"], triton.next_power_of_2(K))
    common = {"H": H, "K": K, "BT": BT, "ARM": x["arm"], "LAM_TOKEN": P.lam_per_token,
              "IS_VARLEN": lay.cu is not None, "PROBES": probes, "DT": lay.DT}
    qed_prep_kernel[lay.grid](
        x["q"], x["k"], x["b"], x["g"], x["lam"], x["z"], x["d"],
        bufs["RQ"], bufs["RK"], bufs["CP"], bufs["GC"], bufs["KG"], bufs["QG"], opt("DG", "QG"), bufs["GL"],
        opt("rho", "RQ"), opt("eig", "RQ"), opt("dpr", "GC"), lay.cu, lay.chunk_indices, T, P.scale,
        BKS=PBKS, NK=triton.cdiv(K, PBKS), L2NORM=x["l2norm"], **common, num_warps=INTRA_CONFIG["prep_warps"],
        num_stages=1,
    )
    qed_solve_kernel[lay.grid](
        x["q"], x["k"], x["v"], x["b"], x["w"], x["lam"], x["z"], x["d"],
        bufs["GC"], bufs["RQ"], bufs["RK"], bufs["CP"], bufs["W"], bufs["U"], bufs["AQK"], opt("ADK", "AQK"),
        bufs["AKK"], lay.cu, lay.chunk_indices, T, P.scale,
        V=V, BC=BC, BKS=BKS, BVS=BVS, NK=triton.cdiv(K, BKS), NV=triton.cdiv(V, BVS), PREC=lay.prec, SPAN=SPAN_MAX,
        **common,
    )
    return bufs


def _scan(lay, P, bufs, h0, o, ht, sd, states):
    """Launch the scan kernel: writes ``o`` and, when given, ``ht``, ``sd`` and ``states``."""
    K, V, ct = P.K, P.V, P.compute_dtype
    BK = triton.next_power_of_2(K)
    BV = 64 if (BK <= 128 and ct != torch.float64) else 32
    BV = min(BV, triton.next_power_of_2(V))
    # bf16 tiles with K <= 128 are pipelined two deep (measured on an H200); float32 / float64
    # [64, K] tiles do not fit twice in shared memory (K=128 asked 295 KB / 426 KB of the 227 KB
    # with two stages), nor do bf16 ones with K=256: one stage there.
    stages = 2 if (bufs["W"].dtype == torch.bfloat16 and BK <= 128) else 1
    probes = sd is not None
    gl = bufs["GL"]
    try:
        qed_scan_kernel[(triton.cdiv(V, BV), P.N * P.H)](
            bufs["W"], bufs["U"], bufs["KG"], bufs["QG"], bufs["DG"] if probes else bufs["QG"], bufs["AQK"],
            bufs["ADK"] if probes else bufs["AQK"], gl, h0 if h0 is not None else gl, o,
            sd if probes else o, ht if ht is not None else gl, states if states is not None else gl,
            lay.cu, lay.chunk_offsets, P.T,
            H=P.H, K=K, V=V, BT=BT, BK=BK, BV=BV,
            USE_H0=h0 is not None, STORE_HT=ht is not None, IS_VARLEN=lay.cu is not None,
            PROBES=probes, STORE_STATES=states is not None, DT=lay.DT, PREC=lay.prec,
            WHILE_LOOP=lay.interpreting, num_warps=4 if BK <= 128 else 8, num_stages=stages,
        )
    except triton.runtime.errors.OutOfResources as err:
        if ct != torch.float64:
            raise
        raise ValueError(f"qed_chunk: float64 inputs with K={K} need more shared memory than this GPU "
                         f"has ({err}); use qed_naive (or float32 inputs) instead") from err


def _kernel_inputs(P, q, k, v, g, b, w, lam, arm, z, d, use_qk_l2norm):
    """The intra kernel's inputs: contiguous tensors, the arm code and placeholders."""
    lam = lam.to(P.compute_dtype).contiguous()
    return {"q": q.contiguous(), "k": k.contiguous(), "v": v.contiguous(), "g": g.contiguous(),
            "b": b.contiguous(), "w": w.contiguous(), "lam": lam,
            "z": z.to(P.compute_dtype).contiguous() if (z is not None and d is None) else lam,
            "d": d.contiguous() if d is not None else q.contiguous(),
            "arm": ARM_GIVEN_D if d is not None else ARM_CODES[arm], "l2norm": bool(use_qk_l2norm)}


def _forward(P, q, k, v, g, b, w, lam, arm, z, d, initial_state, output_final_state, return_probes,
             use_qk_l2norm, cu_seqlens):
    """The forward launches (no autograd): ``(o, final_state, probes)``."""
    inter, prec = _precision(P, q, k, v, b, w)
    lay = _layout(P, cu_seqlens, q.device, prec)
    x = _kernel_inputs(P, q, k, v, g, b, w, lam, arm, z, d, use_qk_l2norm)
    bufs = _intra(lay, P, x, inter, bool(return_probes))
    ct, dev = P.compute_dtype, q.device
    o = torch.empty(P.B, P.T, P.H, P.V, device=dev, dtype=v.dtype)
    ht = torch.empty(P.N, P.H, P.K, P.V, device=dev, dtype=ct) if output_final_state else None
    sd = torch.empty(P.B, P.T, P.H, P.V, device=dev, dtype=ct) if return_probes else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    _scan(lay, P, bufs, h0, o, ht, sd, None)
    probes = {"rho": bufs["rho"], "d": bufs["dpr"], "Sd": sd, "e": bufs["eig"]} if return_probes else None
    return o, ht, probes


class _QEDChunkFunction(torch.autograd.Function):
    """Autograd for ``qed_chunk``: Triton forward, Triton backward (``chunk_bwd.py``).

    Differentiable outputs: ``o`` and the final state; probes are observations (no gradient).
    Once differentiable (no double backward).
    """

    @staticmethod
    def forward(ctx, opts, q, k, v, g, b, w, lam, d, initial_state):
        P, arm, z, output_final_state, return_probes, use_qk_l2norm, cu_seqlens = opts
        ctx.opts = opts
        ctx.save_for_backward(q, k, v, g, b, w, lam, d, initial_state)
        ctx.set_materialize_grads(False)
        o, ht, probes = _forward(P, q, k, v, g, b, w, lam, arm, z, d, initial_state, output_final_state,
                                 return_probes, use_qk_l2norm, cu_seqlens)
        return o, ht, probes

    @staticmethod
    @once_differentiable
    @on_input_device
    def backward(ctx, do, dht, _dprobes):
        P, arm, z, _, _, use_qk_l2norm, cu_seqlens = ctx.opts
        q, k, v, g, b, w, lam, d, h0 = ctx.saved_tensors
        ct = P.compute_dtype
        lay = _layout(P, cu_seqlens, q.device, "ieee" if ct == torch.float64 else "tf32x3")
        bufs = _intra(lay, P, _kernel_inputs(P, q, k, v, g, b, w, lam, arm, z, d, use_qk_l2norm), ct, False)
        states = torch.empty(lay.NC, P.H, P.K, P.V, device=q.device, dtype=ct)
        o = torch.empty(P.B, P.T, P.H, P.V, device=q.device, dtype=ct)
        _scan(lay, P, bufs, h0.contiguous() if h0 is not None else None, o, None, None, states)
        return (None, *input_grads(ctx.needs_input_grad[1:], (q, k, v, g, b, w, lam, d, h0), arm, z,
                                   use_qk_l2norm, P, lay, bufs, states, do, dht))


@on_input_device
def qed_chunk(q, k, v, g, b, w, lam, *, arm="full", z=None, d=None, scale=None, initial_state=None,
              output_final_state=False, return_probes=False, use_qk_l2norm=True, cu_seqlens=None):
    """Chunked Triton QED op; same arguments, results and dtypes as ``qed_naive``.

    Returns ``(o, final_state, probes)``: ``o`` ``[B, T, H, V]`` in ``v``'s dtype, the final
    state ``[N, H, K, V]`` (or ``None``) and, with ``return_probes``, ``{"rho", "d", "Sd", "e"}``
    in the state dtype. Requires CUDA tensors (or ``TRITON_INTERPRET=1`` on CPU).

    Differentiable (Triton backward, ``chunk_bwd.py``) when grad mode is on and any of ``q, k,
    v, g, b, w, lam, d, initial_state`` requires grad: gradients of ``o`` and the final state
    reach all of them (``lam`` per head or per token, ``d`` when given). ``z`` is a fixed buffer
    (no gradient); probes are forward-only observations (no gradient flows through them).
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
        opts = (P, arm, z, output_final_state, return_probes, use_qk_l2norm, cu_seqlens)
        return _QEDChunkFunction.apply(opts, *diff)
    return _forward(P, q, k, v, g, b, w, lam, arm, z, d, initial_state, output_final_state, return_probes,
                    use_qk_l2norm, cu_seqlens)
