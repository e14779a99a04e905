r"""The layers the mixer and the block are built from, with fla's parameter names.

**RMSNorm**, and the sigmoid-gated RMSNorm of the mixer's output (fla's ``RMSNorm`` /
``FusedRMSNormGated(activation="sigmoid")``), computed in float32, returned in the input dtype::

    rms_norm(x)        = x / sqrt(mean(x^2) + eps) * weight
    gated_rms_norm(x, g) = rms_norm(x) * sigmoid(g)

``hook_scale`` shows ``sqrt(mean(x^2) + eps)`` ``[..., 1]`` (TransformerLens' RMS ``hook_scale``,
which ``ActivationCache.apply_ln_to_stack`` divides by); it is a read-only observation, computed
only when hooked, so the normalisation itself is the same arithmetic with or without it.

**ShortConvolution**: causal depthwise short convolution + SiLU, with a carried cache (fla's
``ShortConvolution``).

Per channel ``c`` with kernel ``w_c`` of width ``W`` and the history ``h`` (the last ``W - 1``
inputs before this call, zeros at a sequence start)::

    y_t[c] = silu( sum_{j=0}^{W-1} w_c[j] * x_{t-W+1+j}[c] + bias[c] )

The weight has ``nn.Conv1d``'s shape ``[D, 1, W]`` (key ``weight``, optional ``bias``), so fla's
tensors load unchanged. The cache is ``[N, D, W-1]``: the last ``W - 1`` inputs of each sequence.

Packed input (``cu_seqlens``, N sequences in one row) is convolved in one pass, without a host
synchronisation: each sequence gets its own ``W - 1`` history slots in a padded row
(``T + N (W - 1)`` long), so no tap ever reaches the previous sequence. The arithmetic per
element is the one of the unpacked path: on CUDA packed results equal per-sequence ones bit for
bit; on CPU the SIMD body and scalar tail of ``silu`` may differ in the last bit (float32).

**SwiGLUMLP** with fla's ``GatedMLP`` key names: ``down_proj(silu(gate_proj(x)) * up_proj(x))``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from .hookio import has_hook, observe


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None = None,
             inv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis (times ``sigmoid(gate)``), in
    float32, returned in ``x``'s dtype; ``inv_scale`` (``[..., 1]`` float32) when the caller
    computed ``1 / sqrt(mean(x^2) + eps)`` already. :class:`RMSNorm`'s arithmetic, and the fast
    path's (``fast.py``)."""
    xf = x.float()
    if inv_scale is None:
        inv_scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf * inv_scale * weight.float()
    if gate is not None:
        y = y * torch.sigmoid(gate.float())
    return y.to(x.dtype)


def conv_taps(xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, T: int,
              first_tap: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(sum_j w[j] * xp[:, j:j+T] + bias)`` over rows ``xp`` ``[B, T + W - 1, D]`` (float32),
    ``weight`` ``[D, 1, W]``; ``first_tap`` ``[T]`` (optional) gives each token its first tap
    ``j0``: taps ``j < W - 1`` with ``j < j0`` count as zero (they would reach another sequence).
    :class:`ShortConvolution`'s arithmetic, and the fast path's."""
    W = weight.shape[-1]
    w = weight[:, 0].float()
    y = None
    for j in range(W):
        tap = xp[:, j:j + T] * w[:, j]
        if first_tap is not None and j < W - 1:
            tap = torch.where((first_tap <= j)[:, None], tap, 0.0)
        y = tap if y is None else y + tap
    if bias is not None:
        y = y + bias.float()
    return F.silu(y)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: the SwiGLU product of :class:`SwiGLUMLP` and of the fast path."""
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """RMS normalisation over the last axis with a learned ``weight`` ``[D]``."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.hook_scale = HookPoint()

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[..., D]``; with ``gate`` ``[..., D]`` the result is multiplied by ``sigmoid(gate)``."""
        if not has_hook(self.hook_scale, forward_only=True):
            return rms_norm(x, self.weight, self.eps, gate)
        inv_scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        observe(self.hook_scale, 1 / inv_scale, advice="")
        return rms_norm(x, self.weight, self.eps, gate, inv_scale)


class ShortConvolution(nn.Module):
    """Depthwise causal convolution over ``[B, T, D]`` that respects packed-sequence bounds."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False):
        super().__init__()
        self.hidden_size = hidden_size
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(hidden_size, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def _taps(self, xp: torch.Tensor, T: int) -> torch.Tensor:
        """:func:`conv_taps` with this layer's weight and bias."""
        return conv_taps(xp, self.weight, self.bias, T)

    def _rows(self, x: torch.Tensor, cache: torch.Tensor | None):
        """Convolve ``[B, T, D]`` rows, each one sequence continuing from ``cache`` ``[B, D, W-1]``."""
        B, T, D = x.shape
        W = self.kernel_size
        hist = x.new_zeros(B, W - 1, D) if cache is None else cache.transpose(1, 2).to(x.dtype)
        xp = torch.cat([hist, x], dim=1).float()
        return self._taps(xp, T).to(x.dtype), xp[:, T:].transpose(1, 2).to(x.dtype)

    def _packed(self, x: torch.Tensor, cache: torch.Tensor | None, cu_seqlens: torch.Tensor):
        """Convolve N sequences packed in ``x`` ``[1, T, D]`` (bounds ``cu_seqlens`` ``[N + 1]``)."""
        _, T, D = x.shape
        W, N = self.kernel_size, cu_seqlens.numel() - 1
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        pos = torch.arange(T, device=x.device)
        seq = torch.searchsorted(cu[1:], pos, right=True)  # sequence of each token
        tok_at = pos + (seq + 1) * (W - 1)                  # token slots in the padded row
        hist_at = (cu[:-1] + torch.arange(N, device=x.device) * (W - 1))[:, None] \
            + torch.arange(W - 1, device=x.device)           # [N, W-1] history slots
        xp = x.new_zeros(T + N * (W - 1), D)
        xp[tok_at] = x[0]
        if cache is not None:
            xp[hist_at.flatten()] = cache.transpose(1, 2).to(x.dtype).reshape(-1, D)
        xp = xp.float()[None]
        y = self._taps(xp, T + (N - 1) * (W - 1))[0, tok_at - (W - 1)]  # output j sits at slot j + W - 1
        tail = xp[0, hist_at + (cu[1:] - cu[:-1])[:, None]]             # [N, W-1, D]: last W-1 slots
        return y.to(x.dtype)[None], tail.transpose(1, 2).to(x.dtype)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None):
        """``x`` ``[B, T, D]`` -> ``(y [B, T, D], cache [N, D, W-1])``.

        With ``cu_seqlens`` (``B == 1``) each packed sequence starts from its own row of
        ``cache`` (zeros when ``cache`` is None) and never sees its neighbour's inputs.
        """
        if cu_seqlens is None:
            return self._rows(x, cache)
        return self._packed(x, cache, cu_seqlens)


class SwiGLUMLP(nn.Module):
    """``[..., hidden] -> [..., hidden]`` through ``intermediate_size`` channels."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
