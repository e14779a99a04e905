"""Public QED ops and the dispatcher the model calls.

All ops share one signature::

    o, final_state, probes = op(q, k, v, g, b, w, lam, *, arm="full", z=None, d=None,
                                scale=None, initial_state=None, output_final_state=False,
                                return_probes=False, use_qk_l2norm=True, cu_seqlens=None)

* ``qed_naive``: plain PyTorch token loop, float64-capable, differentiable: the oracle.
* ``qed_chunk``: chunked Triton forward (prefill).      [kernels/qed/chunk.py]
* ``qed_recurrent``: token-by-token Triton kernel (decode). [kernels/qed/fused_recurrent.py]
* ``qed_attention(..., mode="auto")``: Triton on CUDA tensors (recurrent for T == 1, chunk
  otherwise), the PyTorch reference on CPU tensors.
"""
from __future__ import annotations

from qedprobe.kernels.qed import ARMS, PROJECTED_ARMS, qed_naive, value_checks

MODES = ("auto", "naive", "chunk", "recurrent")

__all__ = ["ARMS", "MODES", "PROJECTED_ARMS", "qed_attention", "qed_naive", "value_checks"]


def qed_attention(q, k, v, g, b, w, lam, *, mode="auto", **kwargs):
    """Run the QED recurrence with the best op for the tensors' device (see module docstring).

    ``mode``: ``"auto"`` (default), or force ``"naive"``, ``"chunk"`` or ``"recurrent"``.
    Keyword arguments are those of ``qed_naive``.
    """
    if mode not in MODES:
        raise ValueError(f"qed_attention: `mode` must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        if not q.is_cuda:
            mode = "naive"
        else:
            mode = "recurrent" if q.shape[1] == 1 else "chunk"
    if mode == "naive":
        return qed_naive(q, k, v, g, b, w, lam, **kwargs)
    if mode == "chunk":
        from qedprobe.kernels.qed.chunk import qed_chunk
        return qed_chunk(q, k, v, g, b, w, lam, **kwargs)
    from qedprobe.kernels.qed.fused_recurrent import qed_recurrent
    return qed_recurrent(q, k, v, g, b, w, lam, **kwargs)
