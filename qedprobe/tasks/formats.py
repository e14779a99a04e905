"""The two NIAH task formats (:data:`FORMATS`) and :func:`make_task`, which builds a task of either.

* ``ruler`` (the default, :mod:`qedprobe.tasks.ruler`): NVIDIA RULER's NIAH tasks reproduced
  prompt for prompt, with RULER's length budget, depths, keys and ``string_match_all`` score.
* ``legacy`` (:mod:`qedprobe.tasks.legacy`): qedprobe's earlier format; the shipped checkpoints were trained
  and evaluated on it (their ``config.json`` records ``task_format``).

:func:`make_task` builds either; the legacy names ``s-niah-1/2/3`` and ``mk-niah`` also name
RULER's ``niah_single_1/2/3`` and ``niah_multikey_1`` in the ``ruler`` format. Both formats
produce :class:`qedprobe.tasks.sample.Sample` objects, scored by :func:`answer_fraction` (the share of the answers found
in the prediction: RULER's ``string_match_all`` for one sample) and :func:`score` (all found).
"""
from __future__ import annotations

from .legacy import TASKS, NIAHTask
from .ruler import RULER_TASKS, RulerTask

__all__ = ["DEFAULT_FORMAT", "FORMATS", "RULER_ALIASES", "make_task", "task_names"]

FORMATS = ("ruler", "legacy")
"""Task formats: RULER's prompts (:mod:`qedprobe.tasks.ruler`) and qedprobe's earlier ones
(:mod:`qedprobe.tasks.legacy`)."""

DEFAULT_FORMAT = "ruler"

RULER_ALIASES = {"s-niah-1": "niah_single_1", "s-niah-2": "niah_single_2", "s-niah-3": "niah_single_3",
                 "mk-niah": "niah_multikey_1"}
"""Legacy task names and the RULER task each corresponds to (accepted in the ``ruler`` format)."""


def task_names(format=DEFAULT_FORMAT) -> tuple:
    """The task names a format accepts (for ``ruler``: RULER's names, then the legacy aliases)."""
    _check_format(format)
    if format == "legacy":
        return TASKS
    return tuple(RULER_TASKS) + tuple(RULER_ALIASES)


def _check_format(format):
    if format not in FORMATS:
        raise ValueError(f"unknown task format {format!r}; choose one of {', '.join(FORMATS)}")


def make_task(name, tokenizer="bytes", *, format=DEFAULT_FORMAT, haystack_file=None, chat_template=False,
              **legacy):
    """A task generator of ``format``: :class:`qedprobe.tasks.ruler.RulerTask` or :class:`NIAHTask`.

    ``haystack_file`` applies to both (RULER's essay haystack; the legacy prose haystack);
    ``chat_template`` (wrap the prompts in the tokenizer's chat template) to the ``ruler`` format
    only; the keywords ``num_needles``, ``haystack`` and ``max_new_tokens`` are legacy options
    (RULER fixes them per task) and must be None in the ``ruler`` format."""
    _check_format(format)
    if format == "legacy":
        if chat_template:
            raise ValueError("`chat_template` applies to the ruler format (the legacy format has no chat "
                             "prompts: its models were trained on the raw text)")
        return NIAHTask(name, tokenizer, haystack_file=haystack_file, **legacy)
    given = sorted(k for k, v in legacy.items() if v is not None)
    if given:
        names = ", ".join(f"`{k}`" for k in given)
        raise ValueError(f"only the legacy format takes {names} (RULER's tasks fix them); "
                         f"this task's format is {format!r}")
    return RulerTask(RULER_ALIASES.get(name, name), tokenizer, haystack_file=haystack_file,
                     chat_template=chat_template)
