r"""Chunked (WY / UT-transform) Triton forward of QED for prefill: ``qed_chunk``.

The recurrence (per sequence and head; state ``S`` is ``K x V``)::

    S_bar_t = Diag(exp g_t) S_{t-1}
    a_t     = b_t * k_hat_t + lam_t d_t            (d_t: the arm's direction, arms.py)
    r_t     = w_t * v_t - S_bar_t^T a_t
    S_t     = S_bar_t + k_hat_t r_t^T
    o_t     = S_t^T (scale * q_hat_t)

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

Two launches: ``chunk_intra.qed_intra_kernel`` (per chunk: L2 norms, d, a, probes rho / e / d,
the score blocks, ``(I + A_kk)^{-1}``, ``W``, ``U``, ``kg``, ``qg``) and
``chunk_scan.qed_scan_kernel`` (per sequence, head and value block: the state recurrence fused
with the output and the probe ``Sd``). (A variant splitting the first launch in two, per-row-block
scores then a per-chunk solve, was slower on an H200 — 6.72 ms vs 4.79 ms at the benchmark shape —
and was removed.) Decays ``e^{G_t - G_j}`` are never formed as a product
over long spans: off-diagonal 16-row sub-blocks use a reference point between ``t`` and ``j``
(both factors <= 1) and diagonal sub-blocks fall back to exact per-element exponentials when
their decay span exceeds 30 nats, so any ``g <= 0`` (also ``-inf``-free large negatives) is safe.
With ``return_probes=False`` nothing probe-related is computed or written (``tl.constexpr``).

Precision: float32 arithmetic throughout; matrix products in tf32x3 for float32 inputs and in
tf32 (score rows, WY factors) / bf16 (state recurrence, as fla) for bf16 inputs; float64 inputs
run in float64 (ieee products; on a GPU only for K, V <= 128, else a ValueError). Forward only.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .chunk_intra import ARM_CODES, ARM_GIVEN_D, SPAN_MAX, qed_intra_kernel
from .chunk_scan import qed_scan_kernel
from .inputs import check_qed_inputs

BT = 64
BC = 16
INTRA_CONFIG = {"BKS": 32, "num_warps": 8}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tl_dtype(dt: torch.dtype):
    return {torch.float32: tl.float32, torch.float64: tl.float64}[dt]


def qed_chunk(q, k, v, g, b, w, lam, *, arm="full", z=None, d=None, scale=None, initial_state=None,
              output_final_state=False, return_probes=False, use_qk_l2norm=True, cu_seqlens=None):
    """Chunked Triton QED forward; same arguments, results and dtypes as ``qed_naive``.

    Returns ``(o, final_state, probes)``: ``o`` ``[B, T, H, V]`` in ``v``'s dtype, the final
    state ``[N, H, K, V]`` (or ``None``) and, with ``return_probes``, ``{"rho", "d", "Sd", "e"}``
    in the state dtype. Requires CUDA tensors (or ``TRITON_INTERPRET=1`` on CPU).
    """
    P = check_qed_inputs("qed_chunk", q, k, v, g, b, w, lam, arm=arm, z=z, d=d, scale=scale,
                         initial_state=initial_state, cu_seqlens=cu_seqlens)
    B, T, H, K, V, N = P.B, P.T, P.H, P.K, P.V, P.N
    if K > 256 or V > 256:
        raise ValueError(f"qed_chunk: K and V must be at most 256, got K={K}, V={V}")
    ct = P.compute_dtype
    dev = q.device
    if ct == torch.float64 and q.is_cuda and max(K, V) > 128:
        raise ValueError(f"qed_chunk: float64 inputs on a GPU support K, V <= 128 (the [64, K] float64 "
                         f"tiles of the scan kernel need more shared memory), got K={K}, V={V}; "
                         "use qed_naive or float32 inputs")
    if ct == torch.float64:
        inter = torch.float64
    elif (q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16 and v.dtype == torch.bfloat16
          and not _interpreting()):  # the interpreter's bf16 tl.dot is wrong (raw bits)
        inter = torch.bfloat16
    else:
        inter = torch.float32
    DT = _tl_dtype(ct)
    # float64: ieee; float32 inputs: tf32x3 (float32-accurate products); bf16/fp16: tf32.
    if ct == torch.float64:
        PREC = "ieee"
    elif inter == torch.float32 and all(x.dtype == torch.float32 for x in (q, k, v, b, w)):
        PREC = "tf32x3"
    else:
        PREC = "tf32"

    q, k, v, g, b, w = (x.contiguous() for x in (q, k, v, g, b, w))
    lam = lam.to(ct).contiguous()
    arm_code = ARM_GIVEN_D if d is not None else ARM_CODES[arm]
    zt = z.to(ct).contiguous() if (z is not None and d is None) else lam
    d_in = d.contiguous() if d is not None else q

    if cu_seqlens is not None:
        idx, offs = [], []
        for n, (_, bos, eos) in enumerate(P.seq_bounds):
            offs.append(len(idx))
            idx.extend((n, i) for i in range(triton.cdiv(eos - bos, BT)))
        chunk_indices = torch.tensor(idx, dtype=torch.int32, device=dev)
        chunk_offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
        cu = cu_seqlens.to(device=dev, dtype=torch.int32).contiguous()
        NC = len(idx)
        grid1 = (NC, H)
    else:
        chunk_indices = chunk_offsets = cu = None
        NC = B * triton.cdiv(T, BT)
        grid1 = (triton.cdiv(T, BT), B * H)

    Wt = torch.empty(B, T, H, K, device=dev, dtype=inter)
    KG = torch.empty_like(Wt)
    QG = torch.empty_like(Wt)
    U = torch.empty(B, T, H, V, device=dev, dtype=inter)
    AQK = torch.empty(B, T, H, BT, device=dev, dtype=inter)
    GL = torch.empty(NC, H, K, device=dev, dtype=ct)
    AKK = torch.empty(B, T, H, BT, device=dev, dtype=ct)  # scratch: A_kk, then its inverse
    if return_probes:
        DG = torch.empty_like(Wt)
        ADK = torch.empty_like(AQK)
        rho = torch.empty(B, T, H, device=dev, dtype=ct)
        eig = torch.empty(B, T, H, device=dev, dtype=ct)
        dpr = torch.empty(B, T, H, K, device=dev, dtype=ct)
        sd = torch.empty(B, T, H, V, device=dev, dtype=ct)
    else:
        DG = ADK = rho = eig = dpr = sd = None

    BKS = min(INTRA_CONFIG["BKS"], triton.next_power_of_2(K))
    BVS = min(64, triton.next_power_of_2(V))
    qed_intra_kernel[grid1](
        q, k, v, g, b, w, lam, zt, d_in,
        Wt, U, KG, QG, DG if return_probes else Wt, AQK, ADK if return_probes else AQK, AKK, GL,
        rho if return_probes else GL, eig if return_probes else GL, dpr if return_probes else Wt,
        cu, chunk_indices, T, P.scale,
        H=H, K=K, V=V, BT=BT, BC=BC, BKS=BKS, BVS=BVS, NK=triton.cdiv(K, BKS), NV=triton.cdiv(V, BVS),
        ARM=arm_code, LAM_TOKEN=P.lam_per_token, L2NORM=bool(use_qk_l2norm),
        PROBES=bool(return_probes), SPAN=SPAN_MAX, IS_VARLEN=cu_seqlens is not None, DT=DT, PREC=PREC,
        num_warps=INTRA_CONFIG["num_warps"], num_stages=1,
    )

    o = torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
    ht = torch.empty(N, H, K, V, device=dev, dtype=ct) if output_final_state else None
    BK = triton.next_power_of_2(K)
    BV = 64 if (BK <= 128 and ct != torch.float64) else 32
    BV = min(BV, triton.next_power_of_2(V))
    # bf16 tiles with K <= 128 are pipelined two deep (measured on an H200); float32 / float64
    # [64, K] tiles do not fit twice in shared memory (K=128 asked 295 KB / 426 KB of the 227 KB
    # with two stages), nor do bf16 ones with K=256: one stage there.
    stages = 2 if (inter == torch.bfloat16 and BK <= 128) else 1
    h0 = initial_state.contiguous() if initial_state is not None else None
    try:
        qed_scan_kernel[(triton.cdiv(V, BV), N * H)](
            Wt, U, KG, QG, DG if return_probes else QG, AQK, ADK if return_probes else AQK, GL,
            h0 if h0 is not None else GL, o, sd if return_probes else o, ht if ht is not None else GL,
            cu, chunk_offsets, T,
            H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
            USE_H0=h0 is not None, STORE_HT=ht is not None, IS_VARLEN=cu_seqlens is not None,
            PROBES=bool(return_probes), DT=DT, PREC=PREC, WHILE_LOOP=_interpreting(),
            num_warps=4 if BK <= 128 else 8, num_stages=stages,
        )
    except triton.runtime.errors.OutOfResources as err:
        if ct != torch.float64:
            raise
        raise ValueError(f"qed_chunk: float64 inputs with K={K} need more shared memory than this GPU "
                         f"has ({err}); use qed_naive (or float32 inputs) instead") from err
    probes = None
    if return_probes:
        probes = {"rho": rho, "d": dpr, "Sd": sd, "e": eig}
    return o, ht, probes
