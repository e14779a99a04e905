"""Running a tensor through a hook point: writable inputs and read-only observations.

* :func:`through`: the hook's return value replaces the tensor; its shape must be one of the
  allowed shapes (named in the error).
* :func:`observe`: the hook may look but not change; returning a different tensor is an error.
"""
from __future__ import annotations

import torch
from transformer_lens.hook_points import HookPoint


class WatchedHookPoint(HookPoint):
    """A ``HookPoint`` that calls ``on_change()`` after TransformerLens adds or removes one of its
    hooks (``add_hook`` and ``remove_hooks``, which ``hooks``, ``run_with_hooks``,
    ``run_with_cache`` and ``reset_hooks`` go through), so that its owner can keep something that
    depends on whether it is hooked up to date instead of asking at every call."""

    def __init__(self, on_change):
        super().__init__()
        self.on_change = on_change

    def add_hook(self, *args, **kwargs):
        handle = super().add_hook(*args, **kwargs)
        self.on_change()
        return handle

    def remove_hooks(self, *args, **kwargs) -> None:
        super().remove_hooks(*args, **kwargs)
        self.on_change()


def has_hook(hook: HookPoint, forward_only: bool = False) -> bool:
    """Whether ``hook`` has a TransformerLens hook (forward or backward, or with ``forward_only``
    a forward one; ``add_hook``, ``hooks``, ``run_with_hooks``, ``run_with_cache``): the lists
    ``HookPoint.has_hooks`` reads, without its per-handle filtering (which its defaults do not
    use), because a launch-bound decode step asks this of every hook point of every layer at
    every token."""
    return bool(hook.fwd_hooks) if forward_only else bool(hook.fwd_hooks or hook.bwd_hooks)


def through(hook: HookPoint, x: torch.Tensor, *shapes: tuple) -> torch.Tensor:
    """``hook(x)``, checked to be a tensor of one of ``shapes`` (default: ``x``'s shape); ``x``
    itself, without a module call, where ``hook`` has no hook (:func:`has_hook`)."""
    if not has_hook(hook):
        return x
    out = hook(x)
    allowed = [tuple(s) for s in shapes] or [tuple(x.shape)]
    if not isinstance(out, torch.Tensor) or tuple(out.shape) not in allowed:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"hook `{hook.name}` must return a tensor of shape "
                         f"{' or '.join(map(str, allowed))}, got {got}")
    return out


RECURRENCE_ADVICE = (" To intervene, hook an input of the recurrence (hook_q, hook_k, hook_v, hook_b, "
                     "hook_w, hook_g, hook_lambda or hook_d).")


def observe(hook: HookPoint, x: torch.Tensor, advice: str = RECURRENCE_ADVICE) -> None:
    """Run ``hook`` on ``x`` as a read-only observation (``advice`` ends the error message)."""
    out = hook(x)
    if out is x:
        return
    if not (isinstance(out, torch.Tensor) and out.shape == x.shape and out.device == x.device
            and torch.equal(out, x)):
        raise ValueError(
            f"hook `{hook.name}` is read-only (an observation): it must return None or the tensor "
            f"unchanged.{advice}")
