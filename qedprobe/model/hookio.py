"""Running a tensor through a hook point: writable inputs and read-only observations.

* :func:`through`: the hook's return value replaces the tensor; its shape must be one of the
  allowed shapes (named in the error).
* :func:`observe`: the hook may look but not change; returning a different tensor is an error.
"""
from __future__ import annotations

import torch
from transformer_lens.hook_points import HookPoint


class WatchedHookPoint(HookPoint):
    """A ``HookPoint`` that calls ``on_change()`` after a hook is registered on it (torch's
    ``register_forward_hook``, ``register_forward_pre_hook``, ``register_full_backward_hook``, which
    TransformerLens' ``add_hook`` goes through too) and after TransformerLens removes its hooks
    (``remove_hooks``: ``hooks``, ``run_with_hooks``, ``run_with_cache``, ``reset_hooks``), so that
    its owner can keep something that depends on whether it is hooked up to date instead of asking
    at every call. (A torch hook removed by its own handle calls nothing back: the owner learns of
    it when it next asks :func:`has_hook`.)"""

    def __init__(self, on_change):
        super().__init__()
        self.on_change = on_change

    def register_forward_hook(self, *args, **kwargs):
        handle = super().register_forward_hook(*args, **kwargs)
        self.on_change()
        return handle

    def register_forward_pre_hook(self, *args, **kwargs):
        handle = super().register_forward_pre_hook(*args, **kwargs)
        self.on_change()
        return handle

    def register_full_backward_hook(self, *args, **kwargs):
        handle = super().register_full_backward_hook(*args, **kwargs)
        self.on_change()
        return handle

    def remove_hooks(self, *args, **kwargs) -> None:
        super().remove_hooks(*args, **kwargs)
        self.on_change()


def has_hook(hook: HookPoint, forward_only: bool = False) -> bool:
    """Whether ``hook`` has a hook (forward or backward, or with ``forward_only`` a forward one):
    TransformerLens' (``add_hook``, ``hooks``, ``run_with_hooks``, ``run_with_cache``) or one
    registered with torch's own ``register_forward_hook`` / ``register_forward_pre_hook`` /
    ``register_full_backward_hook``, which TransformerLens' lists do not hold and which would
    otherwise never fire (the hook point is not called where it has no hook). Reads the module's
    hook dicts, where both kinds are, directly: a launch-bound decode step asks this of every hook
    point of every layer at every token."""
    if hook._forward_hooks or hook._forward_pre_hooks:
        return True
    return not forward_only and bool(hook._backward_hooks)


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
