r"""RMSNorm and the sigmoid-gated RMSNorm of the mixer's output (fla's ``RMSNorm`` /
``FusedRMSNormGated(activation="sigmoid")``), computed in float32, returned in the input dtype::

    rms_norm(x)        = x / sqrt(mean(x^2) + eps) * weight
    gated_rms_norm(x, g) = rms_norm(x) * sigmoid(g)
"""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMS normalisation over the last axis with a learned ``weight`` ``[D]``."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[..., D]``; with ``gate`` ``[..., D]`` the result is multiplied by ``sigmoid(gate)``."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        if gate is not None:
            y = y * torch.sigmoid(gate.float())
        return y.to(x.dtype)
