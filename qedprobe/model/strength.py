r"""Inference-time strength: ``lambda_h -> s * lambda_h`` for selected layers and heads
(the paper's Table 4 test, with an optional restriction to the prefill or decode phase).

    with strength(model, 1.5):                       # every head, prefill and decode
        model.generate(prompts, 32)
    with strength(model, 0.0, layers=[3], heads=[0, 2], phase="decode"):
        ...

A forward pass (``model(ids)``, ``run_with_cache``, ``run_with_hooks``) is a prefill; in
``generate`` the prompt pass is the prefill and each new-token step is a decode. Nested blocks
multiply their factors; every block restores the model on exit, also after an exception.
``hook_lambda`` sees lambda after the strength factor. On arm ``gdn2`` lambda is 0, so the
factor has no effect.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from qedprobe.lam import check_strengths

from .hooked import HookedModel

PHASES = ("all", "prefill", "decode")


@dataclass(eq=False)
class StrengthFactor:
    """One active ``strength`` block: a ``[L, H]`` float32 factor for one phase (or ``"all"``)."""

    factor: torch.Tensor
    phase: str


def lambda_scales(factors: list[StrengthFactor], phase: str) -> torch.Tensor | None:
    """Product of the active ``factors`` (a model's ``strength_factors``) that apply to
    ``phase`` (``"prefill"`` or ``"decode"``), ``[L, H]`` float32, or None when none applies."""
    active = [f.factor for f in factors if f.phase in ("all", phase)]
    if not active:
        return None
    out = active[0]
    for f in active[1:]:
        out = out * f
    return out


def index_selection(name: str, value, allowed, who: str = "strength") -> list[int]:
    """``value`` (None: all of ``allowed``; an int; or a list of distinct ints) checked to lie in
    ``allowed`` (a list of indices); the error names ``who`` and ``name``."""
    allowed = list(allowed)
    if value is None:
        return allowed
    items = [value] if isinstance(value, int) else value
    try:
        items = list(items)
    except TypeError:
        raise ValueError(f"{who}: `{name}` must be None, an int or a list of ints, got {value!r}") from None
    bad = [i for i in items if isinstance(i, bool) or not isinstance(i, int) or i not in allowed]
    if not items or bad:
        within = (f"[0, {len(allowed)})" if allowed == list(range(len(allowed)))
                  else f"{allowed}")
        raise ValueError(f"{who}: `{name}` must be a non-empty list of ints in {within}, got {value!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"{who}: `{name}` has repeated entries: {items}")
    return items


def grid_values(name: str, value, shape: tuple, who: str = "strength", dtype=torch.float32) -> torch.Tensor:
    """``value`` (a number, or a tensor of ``shape`` = [selected layers, selected heads]) as a
    finite ``dtype`` tensor on the CPU, 0-d or ``shape``; the errors name ``who`` and ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise ValueError(f"{who}: `{name}` must be a float or a tensor of shape [layers, heads] = "
                         f"{shape}, got {type(value).__name__}")
    value = torch.as_tensor(value, dtype=dtype).detach().cpu()
    if value.dim() != 0 and tuple(value.shape) != shape:
        raise ValueError(f"{who}: tensor `{name}` must have shape [layers, heads] = {shape} "
                         f"(the selected layers x heads), got {tuple(value.shape)}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{who}: `{name}` must be finite")
    return value


@contextlib.contextmanager
def strength(model, s, *, layers=None, heads=None, phase: str = "all",
             allow_extrapolation: bool = False):
    """Multiply lambda of the selected heads by ``s`` while the block is active.

    Args:
        model: a :class:`~qedprobe.model.QEDModel` or a transformers model adapted with
            :func:`qedprobe.hf.adapt` (its layers are the linear-attention layers).
        s: float, or a tensor of shape ``[len(layers), len(heads)]`` (``[L, H]`` by default).
        layers, heads: None (all), an int, or a list of distinct indices.
        phase: ``"all"``, ``"prefill"`` or ``"decode"``.
        allow_extrapolation: permit values of ``s`` outside ``[-1, 2]``.
    """
    if not isinstance(model, HookedModel) or not hasattr(model, "strength_factors"):
        raise ValueError(f"strength: `model` must be a QEDModel or an adapted transformers model "
                         f"(qedprobe.hf.adapt), got {type(model).__name__}")
    cfg = model.cfg
    if phase not in PHASES:
        raise ValueError(f"strength: `phase` must be one of {PHASES}, got {phase!r}")
    rows = index_selection("layers", layers, model.mixer_layers)
    cols = index_selection("heads", heads, range(cfg.num_heads))
    values = grid_values("s", s, (len(rows), len(cols)))
    try:
        check_strengths(values.flatten().tolist(), arm=cfg.arm, allow_extrapolation=allow_extrapolation)
    except ValueError as exc:
        raise ValueError(f"strength: {exc}") from None
    factor = torch.ones(cfg.num_hidden_layers, cfg.num_heads)
    factor[torch.tensor(rows)[:, None], torch.tensor(cols)[None, :]] = values
    entry = StrengthFactor(factor, phase)
    model.strength_factors.append(entry)
    try:
        yield model
    finally:
        model.strength_factors[:] = [f for f in model.strength_factors if f is not entry]
