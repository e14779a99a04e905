r"""The QED strength: ``lambda_h = lambda_max * sigmoid(theta_h)`` (paper App. A, eq. 13).

* one scalar ``theta_h`` per layer and head, initialised to ``-2`` (``lambda ~= 0.0298``);
* ``lambda_max = 0.25`` bounds ``lambda`` to ``(0, 0.25)``;
* ``theta`` trains at 10x the base learning rate (:func:`param_groups`);
* the ``rand`` arm's fixed direction ``z_h`` is drawn once per head from a seed
  (:func:`random_directions`) and kept by the model as a buffer, so it is saved with the weights.
"""
from __future__ import annotations

import torch
from torch import nn

from qedprobe.constants import LAMBDA_MAX, THETA_INIT, THETA_LR_MULT


def lambda_from_theta(theta: torch.Tensor, lambda_max: float = LAMBDA_MAX) -> torch.Tensor:
    """``lambda_max * sigmoid(theta)``, same shape as ``theta``."""
    if not 0 < lambda_max < float("inf"):
        raise ValueError(f"`lambda_max` must be a positive finite number, got {lambda_max!r}")
    return lambda_max * torch.sigmoid(theta)


def init_theta(num_heads: int) -> torch.Tensor:
    """``[H]`` tensor of ``THETA_INIT`` (float32)."""
    if num_heads < 1:
        raise ValueError(f"`num_heads` must be >= 1, got {num_heads}")
    return torch.full((num_heads,), THETA_INIT, dtype=torch.float32)


def random_directions(num_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """``[H, K]`` float32 unit vectors ``z_h``, the same for the same ``(H, K, seed)`` on any machine."""
    if num_heads < 1 or head_dim < 1:
        raise ValueError(f"`num_heads` and `head_dim` must be >= 1, got {num_heads}, {head_dim}")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    z = torch.randn(num_heads, head_dim, generator=gen, dtype=torch.float64)
    return (z / z.norm(dim=-1, keepdim=True)).to(torch.float32)


def param_groups(model: nn.Module, lr: float, weight_decay: float = 0.0,
                 theta_lr_mult: float = THETA_LR_MULT) -> list[dict]:
    """Optimizer groups: every parameter named ``*theta`` at ``lr * theta_lr_mult`` without
    weight decay, all others at ``lr`` with ``weight_decay``. Frozen parameters are left out."""
    theta, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (theta if name.split(".")[-1] == "theta" else rest).append(p)
    groups = [{"params": rest, "lr": lr, "weight_decay": weight_decay, "name": "main"}]
    if theta:
        groups.append({"params": theta, "lr": lr * theta_lr_mult, "weight_decay": 0.0, "name": "theta"})
    return groups


STRENGTH_RANGE = (-1.0, 2.0)
"""The inference-time factors ``s`` (``lambda -> s * lambda``) the paper tested (Table 4)."""


def check_strengths(values, *, arm: str, allow_extrapolation: bool = False) -> None:
    """Refuse strength factors ``s`` that do not apply: outside :data:`STRENGTH_RANGE` (unless
    ``allow_extrapolation``), or other than 1 on arm ``gdn2``, whose lambda is 0.

    ``values``: an iterable of floats. Raises ``ValueError`` naming ``s``.
    """
    values = [float(s) for s in values]
    lo, hi = STRENGTH_RANGE
    if not allow_extrapolation and any(s < lo or s > hi for s in values):
        raise ValueError(f"`s` must lie in [{lo}, {hi}] (the tested range), got {min(values):g}..{max(values):g}; "
                         "pass allow_extrapolation=True to go beyond it")
    if arm == "gdn2" and any(s != 1.0 for s in values):
        raise ValueError("`s` other than 1 does not apply: the model has arm 'gdn2', whose lambda is 0 "
                         "(compare arms with `qedprobe report` instead)")
