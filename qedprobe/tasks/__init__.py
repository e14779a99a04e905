"""NIAH task generators, offline, in two formats (``ruler`` and ``legacy``): the bottom of the house.

Training (``qedprobe.train``) and evaluation (``qedprobe.eval``) both draw their prompts here; this
package imports nothing of qedprobe but the tokenizer.

    from qedprobe.tasks import make_task
    task = make_task("niah_single_1", "bytes")          # qedprobe.tasks.ruler.RulerTask
    sample = task.sample(4096, 0, samples=100, seed=0)  # qedprobe.tasks.sample.Sample
"""
from .control import ForeignKeyTask
from .formats import DEFAULT_FORMAT, FORMATS, RULER_ALIASES, make_task, task_names
from .legacy import NOISE_TEXT, TASKS, NIAHTask
from .ruler import RULER_TASKS, RulerTask
from .sample import (ANSWER_MARGIN, Sample, answer_fraction, answer_tokens, default_prose_path, prompt_sha,
                     score, string_match_all, string_match_part)

__all__ = [
    "ANSWER_MARGIN", "DEFAULT_FORMAT", "FORMATS", "NOISE_TEXT", "RULER_ALIASES", "RULER_TASKS", "TASKS",
    "ForeignKeyTask", "NIAHTask", "RulerTask", "Sample",
    "answer_fraction", "answer_tokens", "default_prose_path", "make_task", "prompt_sha", "score",
    "string_match_all", "string_match_part", "task_names",
]
