r"""Training-free QED: put the erase term ``lam d_t`` into a model trained without it.

    inject_qed(model, 0.1, arm="full")                      # every linear layer, every value head
    inject_qed(model, 0.2, layers=[0, 4], heads=[1, 3])     # only there (lambda 0 elsewhere)
    with strength(model, 1.5): ...                          # then lambda -> 1.5 lambda, as on a QED checkpoint

Each call replaces the whole injection: the selected (layer, value head) pairs get ``lam``, all
others 0, and the model's ``arm`` becomes ``arm`` (one arm per model, as a QED checkpoint). The
erase vector is then ``a_t = beta_t k_hat_t + lam d_t`` with the arm's direction ``d_t`` built
from the layer's own ``q_hat``, ``k_hat`` and ``b = beta 1_K`` (``full``:
``P_perp(beta q_hat) = beta P_perp(q_hat)``, since the gate is a scalar per head).
"""
from __future__ import annotations

import dataclasses

import torch

from qedprobe.lam import LAMBDA_MAX
from qedprobe.model.strength import grid_values, index_selection
from qedprobe.ops import ARMS

from .families import HFQEDConfig
from .model import HFQEDModel


def _lam_values(lam, shape: tuple, allow_extrapolation: bool) -> torch.Tensor:
    """``lam`` (a number or a ``shape`` tensor) as float64 ``shape``, checked to be finite and,
    unless ``allow_extrapolation``, in ``[0, LAMBDA_MAX]`` (the range of a trained QED head)."""
    values = grid_values("lam", lam, shape, "inject_qed", torch.float64)
    lo, hi = float(values.min()), float(values.max())
    if not allow_extrapolation and (lo < 0 or hi > LAMBDA_MAX):
        raise ValueError(f"inject_qed: `lam` must lie in [0, {LAMBDA_MAX}] (lambda_max of a QED head), "
                         f"got {lo:g}..{hi:g}; pass allow_extrapolation=True to go beyond it")
    return values.expand(shape)


def injected_config(cfg: HFQEDConfig, lam, arm: str = "full", *, layers=None, heads=None,
                    rand_seed: int = 0, allow_extrapolation: bool = False) -> HFQEDConfig:
    """``cfg`` with the injection of :func:`inject_qed` (the same arguments), for a model or
    for a folder's config before its weights are read."""
    if arm not in ARMS:
        raise ValueError(f"inject_qed: `arm` must be one of {ARMS}, got {arm!r}")
    if isinstance(rand_seed, bool) or not isinstance(rand_seed, int):
        raise ValueError(f"inject_qed: `rand_seed` must be an int, got {rand_seed!r}")
    rows = index_selection("layers", layers, cfg.linear_layers, who="inject_qed")
    cols = index_selection("heads", heads, range(cfg.num_heads), who="inject_qed")
    values = _lam_values(lam, (len(rows), len(cols)), allow_extrapolation)
    if arm == "gdn2" and bool((values != 0).any()):
        raise ValueError("inject_qed: arm 'gdn2' has no erase direction: `lam` must be 0 (pick another arm)")
    table = [[0.0] * cfg.num_heads for _ in cfg.linear_layers]
    for i, l in enumerate(rows):
        for j, h in enumerate(cols):
            table[cfg.linear_layers.index(l)][h] = float(values[i, j])
    return dataclasses.replace(cfg, arm=arm, lam=tuple(map(tuple, table)), rand_seed=rand_seed)


def inject_qed(model: HFQEDModel, lam, arm: str = "full", *, layers=None, heads=None,
               rand_seed: int = 0, allow_extrapolation: bool = False) -> HFQEDModel:
    """Set lambda of the selected linear-attention layers and value heads to ``lam`` (a float,
    or a tensor ``[len(layers), len(heads)]``), 0 elsewhere, with the erase direction of ``arm``
    (``qedprobe.ops.ARMS``; ``rand`` draws ``z_h`` from ``rand_seed + layer``). ``lam = 0``
    everywhere gives back the model as trained. Returns ``model``."""
    if not isinstance(model, HFQEDModel):
        raise ValueError(f"inject_qed: `model` must be an HFQEDModel (qedprobe.hf.adapt), got {type(model).__name__}")
    model.set_config(injected_config(model.cfg, lam, arm, layers=layers, heads=heads, rand_seed=rand_seed,
                                     allow_extrapolation=allow_extrapolation))
    return model
