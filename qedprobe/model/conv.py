r"""Causal depthwise short convolution + SiLU, with a carried cache (fla's ``ShortConvolution``).

Per channel ``c`` with kernel ``w_c`` of width ``W`` and the history ``h`` (the last ``W - 1``
inputs before this call, zeros at a sequence start)::

    y_t[c] = silu( sum_{j=0}^{W-1} w_c[j] * x_{t-W+1+j}[c] + bias[c] )

The weight has ``nn.Conv1d``'s shape ``[D, 1, W]`` (key ``weight``, optional ``bias``), so fla's
tensors load unchanged. The cache is ``[N, D, W-1]``: the last ``W - 1`` inputs of each sequence.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShortConvolution(nn.Module):
    """Depthwise causal convolution over ``[B, T, D]`` that respects packed-sequence bounds."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False):
        super().__init__()
        self.hidden_size = hidden_size
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(hidden_size, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def _rows(self, x: torch.Tensor, cache: torch.Tensor | None):
        """Convolve ``[B, T, D]`` rows, each one sequence continuing from ``cache`` ``[B, D, W-1]``."""
        B, T, D = x.shape
        W = self.kernel_size
        hist = x.new_zeros(B, W - 1, D) if cache is None else cache.transpose(1, 2).to(x.dtype)
        xp = torch.cat([hist, x], dim=1).float()
        w = self.weight[:, 0].float()
        y = sum(xp[:, j:j + T] * w[:, j] for j in range(W))
        if self.bias is not None:
            y = y + self.bias.float()
        return F.silu(y).to(x.dtype), xp[:, T:].transpose(1, 2).to(x.dtype)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None):
        """``x`` ``[B, T, D]`` -> ``(y [B, T, D], cache [N, D, W-1])``.

        With ``cu_seqlens`` (``B == 1``) each packed sequence starts from its own row of
        ``cache`` (zeros when ``cache`` is None) and never sees its neighbour's inputs.
        """
        if cu_seqlens is None:
            return self._rows(x, cache)
        bounds = cu_seqlens.tolist()
        ys, caches = [], []
        for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
            y, c = self._rows(x[:, bos:eos], None if cache is None else cache[n:n + 1])
            ys.append(y)
            caches.append(c)
        return torch.cat(ys, dim=1), torch.cat(caches, dim=0)
