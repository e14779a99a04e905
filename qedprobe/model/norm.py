r"""RMSNorm and the sigmoid-gated RMSNorm of the mixer's output (fla's ``RMSNorm`` /
``FusedRMSNormGated(activation="sigmoid")``), computed in float32, returned in the input dtype::

    rms_norm(x)        = x / sqrt(mean(x^2) + eps) * weight
    gated_rms_norm(x, g) = rms_norm(x) * sigmoid(g)

``hook_scale`` shows ``sqrt(mean(x^2) + eps)`` ``[..., 1]`` (TransformerLens' RMS ``hook_scale``,
which ``ActivationCache.apply_ln_to_stack`` divides by); it is a read-only observation, computed
only when hooked, so the normalisation itself is the same arithmetic with or without it.
"""
from __future__ import annotations

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from .hookio import observe


class RMSNorm(nn.Module):
    """RMS normalisation over the last axis with a learned ``weight`` ``[D]``."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.hook_scale = HookPoint()

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[..., D]``; with ``gate`` ``[..., D]`` the result is multiplied by ``sigmoid(gate)``."""
        xf = x.float()
        inv_scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.hook_scale.has_hooks(dir="fwd"):
            observe(self.hook_scale, 1 / inv_scale, advice="")
        y = xf * inv_scale * self.weight.float()
        if gate is not None:
            y = y * torch.sigmoid(gate.float())
        return y.to(x.dtype)
