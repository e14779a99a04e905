"""The training mixtures: which documents :class:`qedprobe.train.data.TrainData` draws, with
what weight (plain data, no torch: ``qedprobe train --help`` lists the names)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MIXTURES", "QUERIES", "Component"]

QUERIES = ("one", "all", "random")
"""How a document asks its needles (:attr:`Component.queries`)."""


@dataclass(frozen=True)
class Component:
    """One part of a mixture: a task of ``qedprobe.tasks.TASKS``, its sampling weight, the
    haystack (``mk-niah`` only: ``"noise"`` or ``"prose"``), the inclusive needle-count range and
    ``queries``: ``"one"`` (the sample's asked needle), ``"all"`` or ``"random"`` (``mk-niah``
    only: every needle asked once, or needles drawn with replacement; see :mod:`qedprobe.train.data`)."""

    task: str
    weight: float
    haystack: str | None = None
    needles: tuple[int, int] = (1, 1)
    queries: str = "one"

    def __post_init__(self):
        if self.queries not in QUERIES:
            raise ValueError(f"Component: `queries` must be one of {QUERIES}, got {self.queries!r}")
        if self.queries != "one" and self.task != "mk-niah":
            raise ValueError(f"Component: `queries={self.queries!r}` needs task 'mk-niah', got {self.task!r}")


MIXTURES = {
    # Retrieval under interference: single needles in noise and prose, number and UUID values,
    # 2-8 needles with distinct keys in noise or prose (one asked, the others interfere).
    "niah": (
        Component("s-niah-1", 0.25),
        Component("s-niah-2", 0.15),
        Component("s-niah-3", 0.10),
        Component("mk-niah", 0.25, "noise", (2, 8)),
        Component("mk-niah", 0.25, "prose", (2, 8)),
    ),
    # The same kinds of documents, only those that fit rows of 512 tokens (CPU micro model).
    "short": (
        Component("s-niah-1", 0.4),
        Component("s-niah-2", 0.3),
        Component("mk-niah", 0.3, "noise", (2, 2)),
    ),
    # Key-matched retrieval under interference: 2-16 needles in noise and prose, as many queries
    # as needles drawn with replacement (most of the weight), plus the single-needle tasks. Rows
    # of >= 4096 bytes, or fewer tokens with a BPE tokenizer (qedprobe train-tokenizer).
    "interference": (
        Component("s-niah-1", 0.10),
        Component("s-niah-2", 0.10),
        Component("s-niah-3", 0.05),
        Component("mk-niah", 0.375, "noise", (2, 16), "random"),
        Component("mk-niah", 0.375, "prose", (2, 16), "random"),
    ),
    # The interference mixture cut to 2-4 needles, for rows of 512 BPE tokens (CPU models).
    "interference-short": (
        Component("s-niah-1", 0.10),
        Component("mk-niah", 0.45, "noise", (2, 4), "random"),
        Component("mk-niah", 0.45, "prose", (2, 4), "random"),
    ),
    # 2-4 needles with every needle asked once, for rows of 512 BPE tokens or 1280 bytes (the CPU
    # pilots of CHANGELOG.md's measurement history; "all" has the elimination shortcut of the module docstring).
    "interference-micro": (
        Component("s-niah-1", 0.10),
        Component("mk-niah", 0.45, "noise", (2, 4), "all"),
        Component("mk-niah", 0.45, "prose", (2, 4), "all"),
    ),
}
