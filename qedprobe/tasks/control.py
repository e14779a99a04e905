"""The foreign-key control of MK-NIAH: the same prompt, but the question asks a key that no needle has.

A model that matches the asked key writes the asked needle's value on the real prompt and has
no reason to prefer that needle when the key is foreign: its score (the asked needle's value
in the continuation) falls to about ``1 / num_needles`` or below. A model that picks a needle
by anything else (position, recency, a fixed preference) scores the same on both. So a real
accuracy well above ``1 / num_needles`` *and* a control at or below it is evidence of key
matching; a control as high as the real prompt is evidence against it.

:class:`ForeignKeyTask` is a :class:`qedprobe.tasks.legacy.NIAHTask` whose samples are the
controls of the parent's samples (same haystack, needles, depth and ``answer``), so
:func:`qedprobe.eval.sweep.run_sweep` and everything downstream of it run on them unchanged.
"""
from __future__ import annotations

import dataclasses

from .legacy import NIAHTask
from .sample import Sample

__all__ = ["ForeignKeyTask", "ask_key", "query_line"]

FOREIGN_SEED_OFFSET = 1_000_003
"""The foreign key of sample ``(length, i, seed)`` is taken from the needles of sample
``(length, i, seed + FOREIGN_SEED_OFFSET)``: another seed stream, so an independent key."""


def query_line(sample: Sample, key: str) -> str:
    """The last line of ``sample.prompt`` (its question and answer prefix) asking ``key``
    instead of the sample's own key."""
    line = sample.prompt.rsplit("\n", 1)[-1]
    if sample.key not in line:
        raise ValueError(f"query_line: the prompt's last line {line!r} does not name the asked key {sample.key!r}")
    return line.replace(sample.key, key)


def ask_key(task: NIAHTask, sample: Sample, key: str) -> Sample:
    """``sample`` (legacy format) with its question (last prompt line) asking ``key``; ``answer``
    and ``needles`` unchanged, ``key`` set to the new key, ``counted_tokens`` moved by the change
    in prompt tokens. ``input_ids`` are re-encoded as BOS + the text, which
    must reproduce the original sample's ids (checked)."""
    tok = task.tokenizer
    bos = [] if tok.bos_id is None else [tok.bos_id]
    if bos + tok.encode(sample.prompt) != list(sample.input_ids):
        raise ValueError(f"ask_key: task {task.name} does not encode its prompts as BOS + text")
    head = sample.prompt.rsplit("\n", 1)[0]
    prompt = f"{head}\n{query_line(sample, key)}"
    ids = bos + tok.encode(prompt)
    counted = sample.counted_tokens + len(ids) - len(sample.input_ids)
    return dataclasses.replace(sample, prompt=prompt, input_ids=ids, key=key, counted_tokens=counted)


class ForeignKeyTask(NIAHTask):
    """``mk-niah`` whose every sample asks a key that none of its needles has (see the module
    docstring); the score still looks for the value of the sample's asked needle. Same
    arguments as :class:`NIAHTask` (``name`` must be ``"mk-niah"``). A control prompt is a few
    tokens longer or shorter than its real prompt (keys differ in length)."""

    def __init__(self, name="mk-niah", tokenizer="bytes", **kwargs):
        if name != "mk-niah":
            raise ValueError(f"ForeignKeyTask: `name` must be 'mk-niah', got {name!r}")
        super().__init__(name, tokenizer, **kwargs)

    def describe(self) -> dict:
        return {**super().describe(), "control": "foreign-key"}

    def sample(self, length: int, i: int, *, samples: int, seed: int = 0) -> Sample:
        real = super().sample(length, i, samples=samples, seed=seed)
        own = {k for k, _, _ in real.needles}
        other = super().sample(length, i, samples=samples, seed=seed + FOREIGN_SEED_OFFSET)
        key = next((k for k, _, _ in other.needles if k not in own), None)
        if key is None:
            raise ValueError(f"ForeignKeyTask: no foreign key for sample {i} at length {length}")
        return ask_key(self, real, key)
