"""Public QED ops and the dispatcher the model calls.

All ops share one signature::

    o, final_state, probes = op(q, k, v, g, b, w, lam, *, arm="full", z=None, d=None,
                                scale=None, initial_state=None, output_final_state=False,
                                return_probes=False, use_qk_l2norm=True, cu_seqlens=None)

The gates ``g, b, w`` are per channel (``[B, T, HV, K]`` / ``[B, T, HV, V]``) or one scalar per
token and value head (``[B, T, HV]``: Gated DeltaNet's decay and ``beta``; KDA's ``beta`` with a
per-channel ``g``), read as given (no broadcast copy) by every op.

* ``qed_naive``: plain PyTorch token loop, float64-capable, differentiable: the oracle.
* ``qed_chunk_torch``: the chunk algorithm in plain PyTorch, differentiable: the CPU path.
* ``qed_chunk``: chunked Triton forward (prefill) with a Triton backward.  [kernels/qed/chunk*.py]
* ``qed_recurrent``: token-by-token Triton kernel (decode; forward only).  [kernels/qed/fused_recurrent.py]
* ``qed_attention(..., mode="auto")``: Triton on CUDA tensors (recurrent for T == 1, chunk
  otherwise); on CPU tensors the token loop for T == 1 (a decode step) and ``qed_chunk_torch``
  otherwise. ``inplace_final_state=True`` (the recurrent op only) writes the final state over
  ``initial_state``.
"""
from __future__ import annotations

import torch

from qedprobe.kernels.qed import (ARMS, LAMBDA_BOUND, PROJECTED_ARMS, qed_chunk, qed_chunk_torch, qed_naive,
                                  qed_recurrent, value_checks)
from qedprobe.constants import MODES
from qedprobe.kernels.qed.inputs import QEDOutput

OPS = dict(zip(MODES[1:], (qed_naive, qed_chunk_torch, qed_chunk, qed_recurrent)))
"""The named ops of :data:`MODES` (all but ``auto``)."""

__all__ = ["ARMS", "LAMBDA_BOUND", "MODES", "PROJECTED_ARMS", "qed_attention", "qed_chunk", "qed_chunk_torch", "qed_naive",
           "qed_recurrent", "value_checks"]


def qed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
                  w: torch.Tensor, lam: torch.Tensor, *, mode: str = "auto", inplace_final_state: bool = False,
                  **kwargs) -> QEDOutput:
    """Run the QED recurrence with the best op for the tensors' device (see module docstring).

    Args:
        q, k, v, g, b, w, lam: as ``qed_naive`` (``q, k`` ``[B, T, H, K]``, ``v`` ``[B, T, HV, V]``;
            the gates ``g, b, w`` per channel or ``[B, T, HV]``, one scalar per value head).
        mode: ``"auto"`` (default), or force ``"naive"``, ``"torch"``, ``"chunk"`` or ``"recurrent"``.
        inplace_final_state: passed to ``qed_recurrent``, the one op that has it (a ValueError
            names the mode where another op runs).
        **kwargs: the keyword arguments of ``qed_naive`` (``arm, z, d, scale, initial_state,
            output_final_state, return_probes, use_qk_l2norm, cu_seqlens``).

    Returns:
        ``(o, final_state, probes)`` of the op that ran.
    """
    if mode not in MODES:
        raise ValueError(f"qed_attention: `mode` must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        one_step = q.shape[1] == 1
        if q.is_cuda:
            mode = "recurrent" if one_step else "chunk"
        else:
            mode = "naive" if one_step else "torch"
    if inplace_final_state:
        if mode != "recurrent":
            raise ValueError(f"qed_attention: `inplace_final_state=True` needs the recurrent op (CUDA tensors, "
                             f"one token per sequence, mode 'auto' or 'recurrent'); this call runs {mode!r}")
        kwargs["inplace_final_state"] = True
    op = OPS[mode]
    try:
        return op(q, k, v, g, b, w, lam, **kwargs)
    except ValueError as err:  # the op's checks name the op; the caller called qed_attention
        text = str(err)
        if not text.startswith(f"{op.__name__}: "):
            raise
        raise ValueError(f"qed_attention (mode {mode!r}): {text.removeprefix(f'{op.__name__}: ')}") from None
