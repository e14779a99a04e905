r"""Intervention hooks for the writable inputs of the QED recurrence.

* :func:`scale_lambda` (on ``hook_lambda``): ``lambda -> s * lambda``.
* :func:`zero_direction` (on ``hook_d``): ``d -> 0`` (the step becomes GDN-2).
* :class:`DirectionReplacement` (on ``hook_k``, ``hook_b``, ``hook_d``): replace the arm's
  direction by a fixed per-head vector ``z_h``, gated and projected like the rand arm::

      d_t = P_perp(b_t * z_h) = b_t * z_h - k_hat_t (k_hat_t . (b_t * z_h))

  (``gate=False`` drops ``b_t``, ``project=False`` drops ``P_perp``).
"""
from __future__ import annotations

import torch

from qedprobe.kernels.qed import l2_normalize, project_out
from qedprobe.model.hooked import hook_name


def scale_lambda(s):
    """Hook for ``blocks.{l}.attn.hook_lambda``: multiply lambda by ``s`` (float or ``[H]``)."""
    def hook(lam, hook):
        return lam * torch.as_tensor(s, dtype=lam.dtype, device=lam.device)
    return hook


def zero_direction(d, hook):
    """Hook for ``blocks.{l}.attn.hook_d``: the zero direction."""
    return torch.zeros_like(d)


class DirectionReplacement:
    """Replace ``d`` with a direction built from fixed unit vectors ``z`` ``[H, K]``.

    ``fwd_hooks(layers)`` returns the ``(name, fn)`` pairs: ``hook_k`` and ``hook_b`` record the
    layer's key and gate (they return None; the gate per channel ``[B, T, H, K]`` or scalar
    ``[B, T, H]``), ``hook_d`` returns the new direction.
    """

    def __init__(self, z: torch.Tensor, *, gate: bool = True, project: bool = True):
        if not isinstance(z, torch.Tensor) or z.dim() != 2:
            raise ValueError(f"DirectionReplacement: `z` must be a tensor [H, K], got {getattr(z, 'shape', z)!r}")
        self.z = z / z.norm(dim=-1, keepdim=True)
        self.gate, self.project = gate, project
        self._k, self._b = {}, {}

    def _store(self, table):
        def hook(x, hook):
            table[hook.layer()] = x
        return hook

    def _replace(self, d, hook):
        layer = hook.layer()
        if tuple(self.z.shape) != tuple(d.shape[-2:]):
            raise ValueError(f"DirectionReplacement: `z` has shape {tuple(self.z.shape)}, "
                             f"but {hook.name} is [B, T, H, K] = {tuple(d.shape)}")
        u = self.z.to(d)
        if self.gate:
            b = self._b.pop(layer).to(d)
            u = (b if b.dim() == d.dim() else b.unsqueeze(-1)) * u  # a scalar gate b [B, T, H]
        else:
            u = u.expand_as(d)
        if self.project:
            u = project_out(u, l2_normalize(self._k.pop(layer).to(d)))
        return u

    def fwd_hooks(self, layers, mixer_name: str = "attn") -> list:
        """``[(hook name, fn)]`` for the given layer indices, for ``run_with_hooks`` / ``model.hooks``;
        ``mixer_name`` is the model's (``model.mixer_name``: ``"linear_attn"`` for a transformers
        model from ``qedprobe.hf``)."""
        out = []
        for l in layers:
            out += [(hook_name("k", l, mixer_name), self._store(self._k)),
                    (hook_name("b", l, mixer_name), self._store(self._b)),
                    (hook_name("d", l, mixer_name), self._replace)]
        return out
