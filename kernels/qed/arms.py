"""The erase direction ``d_t`` of each arm, and the erase vector ``a_t``.

With ``q_hat, k_hat`` the (L2-normalised) query and key, ``b`` the erase gate and
``P_perp(u) = u - k_hat (k_hat . u)`` (a projection when ``||k_hat|| = 1``)::

    gdn2           d = 0
    nogate_noproj  d = q_hat
    nogate         d = P_perp(q_hat)
    full           d = P_perp(b * q_hat)
    rand           d = P_perp(b * z_h)       z_h: fixed unit vector of head h
    noproj         d = b * q_hat             (gate yes, projection no)

    a_t = b_t * k_hat_t + lam * d_t

Shapes (grouped value heads already expanded: one row per value head): ``q, k, b``
``[B, T, HV, K]``, ``z`` ``[HV, K]``, ``lam`` ``[B, T, HV]``. ``z`` is one vector per *value*
head, because the direction, like ``b``, belongs to the state it erases from.

The Triton kernels take an arm as three compile-time flags (:func:`direction_flags`): where the
raw direction comes from (``DIR_SOURCE``: ``"none"``, ``"q"``, ``"z"`` or a given ``"d"``),
whether the erase gate multiplies it (``DIR_GATED``) and whether ``k`` is projected out
(``DIR_PROJECTED``): ``d = P_perp(b * x)`` or its ungated / unprojected variants.
"""
from __future__ import annotations

import torch

from .inputs import ARMS

PROJECTED_ARMS = ("nogate", "full", "rand")
"""Arms whose direction is orthogonal to k: their eigenvalue e_t = 1 - sum_i b_i k_i^2."""


_DIRECTION_FLAGS = {
    "gdn2": ("none", False, False),
    "nogate_noproj": ("q", False, False),
    "nogate": ("q", False, True),
    "full": ("q", True, True),
    "rand": ("z", True, True),
    "noproj": ("q", True, False),
}


def direction_flags(arm: str, d_given: bool) -> dict:
    """The kernels' compile-time description of ``d_t`` for ``arm`` (a given ``d`` is used as is)."""
    if arm not in _DIRECTION_FLAGS:
        raise ValueError(f"`arm` must be one of {ARMS}, got {arm!r}")
    source, gated, projected = ("d", False, False) if d_given else _DIRECTION_FLAGS[arm]
    return {"DIR_SOURCE": source, "DIR_GATED": gated, "DIR_PROJECTED": projected}


def project_out(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``u - k (k . u)`` along the last axis."""
    return u - k * (k * u).sum(-1, keepdim=True)


def erase_direction(q: torch.Tensor, k: torch.Tensor, b: torch.Tensor, arm: str, z: torch.Tensor | None = None):
    """The arm's direction ``d_t``, ``[B, T, HV, K]``, from normalised ``q, k`` and the gate ``b``."""
    if arm == "gdn2":
        return torch.zeros_like(q)
    if arm == "nogate_noproj":
        return q
    if arm == "nogate":
        return project_out(q, k)
    if arm == "full":
        return project_out(b * q, k)
    if arm == "rand":
        return project_out(b * z.to(q.dtype), k)
    if arm == "noproj":
        return b * q
    raise ValueError(f"`arm` must be one of {ARMS}, got {arm!r}")


def erase_vector(k: torch.Tensor, b: torch.Tensor, lam: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``a_t = b_t * k_t + lam_t d_t`` with ``lam`` ``[B, T, HV]``."""
    return b * k + lam.unsqueeze(-1) * d
