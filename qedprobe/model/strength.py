r"""Inference-time strength: ``lambda_h -> s * lambda_h`` for selected layers and heads
(the paper's Table 4 test, with an optional restriction to the prefill or decode phase).

    with strength(model, 1.5):                       # every head, prefill and decode
        model.generate(prompts, 32)
    with strength(model, 0.0, layers=[3], heads=[0, 2], phase="decode"):
        ...

A forward pass (``model(ids)``, ``run_with_cache``, ``run_with_hooks``) is a prefill; in
``generate`` the prompt pass is the prefill and each new-token step is a decode. Nested blocks
multiply their factors; every block ends with its ``with`` statement, also after an exception.
``hook_lambda`` sees lambda after the strength factor. On arm ``gdn2`` lambda is 0, so the
factor has no effect.

The factors reach the recurrence as a value, not as state on the model: a :class:`LambdaScale`
(the product of the active factors, per phase) that a forward pass receives, ``model(ids,
lambda_scale=...)``, ``model.generate(..., lambda_scale=...)``, and passes down to each layer's
lambda. A ``strength`` block makes its factor the default of the calls inside it, in this
thread (or asyncio task) only: the blocks entered are held in a ``contextvars.ContextVar``
(:func:`active_lambda_scale`), and the model object is never changed.

    scale = LambdaScale.select(model, 0.0, layers=[3])   # the same checks as strength(...)
    model.generate(prompts, 16, lambda_scale=scale)      # as inside `with strength(model, 0.0, layers=[3])`
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

from qedprobe.lam import check_strengths

from .hooked import HookedModel

PHASES = ("all", "prefill", "decode")


@dataclass(frozen=True, eq=False)
class StrengthFactor:
    """One strength: a ``[L, H]`` float32 factor (on the CPU) for one phase (or ``"all"``), and
    its copies on the devices it was asked for (:meth:`on`)."""

    factor: torch.Tensor
    phase: str
    copies: dict = field(default_factory=dict, repr=False)

    def on(self, device: torch.device) -> torch.Tensor:
        """The factor on ``device``, copied there once for the block's lifetime: a transformers
        model asks for it in every layer at every decode step, and a copy from pageable host
        memory each time would wait for the device each time."""
        device = torch.device(device)
        if device not in self.copies:
            self.copies[device] = self.factor.to(device)
        return self.copies[device]


@dataclass(frozen=True)
class LambdaScale:
    """The lambda factors a forward pass applies: ``factors`` (nested strengths, outermost
    first), each for ``"all"`` phases or one. Empty: lambda as trained."""

    factors: tuple[StrengthFactor, ...] = ()

    @classmethod
    def select(cls, model, s, *, layers=None, heads=None, phase: str = "all",
               allow_extrapolation: bool = False) -> "LambdaScale":
        """The scale ``s`` on ``layers`` x ``heads`` in ``phase``, checked as :func:`strength`
        checks it (the arguments are :func:`strength`'s)."""
        return cls((strength_factor(model, s, layers=layers, heads=heads, phase=phase,
                                    allow_extrapolation=allow_extrapolation),))

    def for_phase(self, phase: str, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """Product of the factors that apply to ``phase`` (``"prefill"`` or ``"decode"``), ``[L, H]``
        float32 on ``device``, or None when none applies (each factor is copied to ``device``
        once: :meth:`StrengthFactor.on`)."""
        if not self.factors:
            return None
        active = [f.on(device) for f in self.factors if f.phase in ("all", phase)]
        if not active:
            return None
        out = active[0]
        for f in active[1:]:
            out = out * f
        return out


_ACTIVE_BLOCKS: contextvars.ContextVar[tuple] = contextvars.ContextVar("qedprobe_strength_blocks", default=())
"""The ``strength`` blocks active in this context: ``((model, StrengthFactor), ...)``, as entered."""


_CALL_SCALES: contextvars.ContextVar[tuple] = contextvars.ContextVar("qedprobe_call_scales", default=())
"""The scales given to the calls now running (:func:`call_lambda_scale`): ``((model, LambdaScale), ...)``."""


_NO_SCALE = LambdaScale()
"""Lambda as trained: what :func:`active_lambda_scale` gives outside every block and scaled call."""


def active_lambda_scale(model) -> LambdaScale:
    """The :class:`LambdaScale` that ``model``'s layers apply now: the one given to the innermost
    call of ``model`` that was given one (:func:`call_lambda_scale`), else that of the
    ``strength`` blocks around this call that name ``model``."""
    calls, blocks = _CALL_SCALES.get(), _ACTIVE_BLOCKS.get()
    if not (calls or blocks):  # asked by each layer at each decode step: nothing to search
        return _NO_SCALE
    given = next((scale for owner, scale in reversed(calls) if owner is model), None)
    if given is not None:
        return given
    return LambdaScale(tuple(factor for owner, factor in blocks if owner is model))


@contextlib.contextmanager
def call_lambda_scale(model, scale: LambdaScale | None):
    """Inside this block ``model``'s layers apply ``scale`` (None: nothing changes): how a call
    given ``lambda_scale=`` hands it to layers that another library calls (``qedprobe.hf``:
    transformers runs the decoder layers)."""
    if scale is None:
        yield
        return
    token = _CALL_SCALES.set(_CALL_SCALES.get() + ((model, scale),))
    try:
        yield
    finally:
        _CALL_SCALES.reset(token)


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
    """Multiply lambda of the selected heads by ``s`` while the block is active (the calls of
    ``model`` inside it that are given no ``lambda_scale`` of their own).

    Args:
        model: a :class:`~qedprobe.model.QEDModel` or a transformers model adapted with
            :func:`qedprobe.hf.adapt` (its layers are the linear-attention layers).
        s: float, or a tensor of shape ``[len(layers), len(heads)]`` (``[L, H]`` by default).
        layers, heads: None (all), an int, or a list of distinct indices.
        phase: ``"all"``, ``"prefill"`` or ``"decode"``.
        allow_extrapolation: permit values of ``s`` outside ``[-1, 2]``.
    """
    entry = strength_factor(model, s, layers=layers, heads=heads, phase=phase,
                            allow_extrapolation=allow_extrapolation)
    _ACTIVE_BLOCKS.set(_ACTIVE_BLOCKS.get() + ((model, entry),))
    try:
        yield model
    finally:
        _ACTIVE_BLOCKS.set(tuple(block for block in _ACTIVE_BLOCKS.get() if block[1] is not entry))


def strength_factor(model, s, *, layers=None, heads=None, phase: str = "all",
                    allow_extrapolation: bool = False) -> StrengthFactor:
    """The checked :class:`StrengthFactor` of :func:`strength`'s arguments: ``[L, H]`` ones with
    ``s`` on the selected layers x heads."""
    if not isinstance(model, HookedModel) or not hasattr(model, "mixer_layers"):
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
    return StrengthFactor(factor, phase)
