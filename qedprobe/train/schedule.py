r"""Warmup-stable-decay (WSD) learning-rate schedule.

For optimizer step ``s = 0 .. total-1`` (the step about to be taken) the base learning rate of
every parameter group is multiplied by

    m(s) = (s + 1) / W                                    s <  W            (linear warmup)
    m(s) = 1                                              W <= s < total - D (stable)
    m(s) = r + (1 - r) * (total - s) / D                  s >= total - D     (linear decay)

with ``W = warmup_steps``, ``D = decay_steps`` and ``r = min_ratio``. The first step already
has a non-zero rate (``1/W``), the first decay step has ``m = 1`` and the last one
``r + (1 - r) / D``, so no step is wasted at rate zero. Steps past ``total`` (``LambdaLR`` asks
for ``m(total)`` after the last step) get ``r`` (``1`` when ``D = 0``). Because every group is scaled by the same
``m(s)``, the QED strength ``theta`` keeps its 10x learning rate (:func:`qedprobe.lam.param_groups`)
through the whole schedule.

:class:`WSD` is a plain callable object, so ``torch.optim.lr_scheduler.LambdaLR`` saves and restores
it in its ``state_dict`` (resuming needs nothing else).
"""
from __future__ import annotations

import torch


def _int_at_least(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"WSD: `{name}` must be an int >= {low}, got {value!r}")
    return value


class WSD:
    """``m(step)`` of the warmup-stable-decay schedule (see module docstring)."""

    def __init__(self, total_steps: int, warmup_steps: int, decay_steps: int, min_ratio: float = 0.0):
        self.total_steps = _int_at_least("total_steps", total_steps, 1)
        self.warmup_steps = _int_at_least("warmup_steps", warmup_steps, 0)
        self.decay_steps = _int_at_least("decay_steps", decay_steps, 0)
        if warmup_steps + decay_steps > total_steps:
            raise ValueError(f"WSD: `warmup_steps` + `decay_steps` ({warmup_steps} + {decay_steps}) "
                             f"must not exceed `total_steps` ({total_steps})")
        if isinstance(min_ratio, bool) or not isinstance(min_ratio, (int, float)) or not 0 <= min_ratio <= 1:
            raise ValueError(f"WSD: `min_ratio` must be a number in [0, 1], got {min_ratio!r}")
        self.min_ratio = float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"WSD: `step` must be >= 0, got {step}")
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay_steps == 0 or step < self.total_steps - self.decay_steps:
            return 1.0
        left = max(self.total_steps - step, 0)
        return self.min_ratio + (1.0 - self.min_ratio) * left / self.decay_steps


def wsd_scheduler(optimizer: torch.optim.Optimizer, schedule: WSD) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` that scales every group's initial rate by ``schedule(step)``."""
    if not isinstance(schedule, WSD):
        raise ValueError(f"wsd_scheduler: `schedule` must be a WSD, got {type(schedule).__name__}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
