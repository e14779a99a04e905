"""What both task formats share: the :class:`Sample`, its scoring and the shipped haystack.

A sample is scored as RULER scores it: :func:`answer_fraction` is the share of its answers found
in the prediction (case-insensitive; RULER's ``string_match_all`` for one sample) and
:func:`score` whether all of them are; :func:`string_match_all` and :func:`string_match_part`
are RULER's metrics over many samples, in percent.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from importlib import resources

__all__ = ["ANSWER_MARGIN", "Sample", "answer_fraction", "answer_tokens", "default_prose_path", "prompt_sha",
           "score", "string_match_all", "string_match_part"]

ANSWER_MARGIN = 2
"""New tokens past the answer itself that :func:`answer_tokens` allows (an EOS, or an
answer that tokenises one token longer in context)."""

def default_prose_path():
    """Path of the shipped prose haystack (original text written for qedprobe, public domain)."""
    return resources.files("qedprobe.tasks").joinpath("data/haystack_prose.txt")

def prompt_sha(input_ids) -> str:
    """A short fingerprint of a prompt's token ids (pairs rows of different runs)."""
    return hashlib.sha1(array("q", [int(i) for i in input_ids]).tobytes()).hexdigest()[:16]


@dataclass
class Sample:
    """One generated prompt. ``input_ids`` include the BOS token (if the tokenizer has one; a
    RULER prompt in a chat template has the template's own special tokens instead).

    ``answers``: every value the prompt asks for (one, or several for RULER's multi-value and
    multi-query tasks); ``answer`` is the first. ``counted_tokens``: the tokens the format counts
    against ``length`` (legacy: ``input_ids`` and ``max_new_tokens``; RULER: the prompt without
    special tokens and its 128 generated tokens)."""

    task: str
    length: int
    sample_id: int
    seed: int
    prompt: str
    input_ids: list
    answer: str
    key: str
    depth: float
    max_new_tokens: int
    needles: list = field(default_factory=list)  # [(key, value, depth)] of every needle, asked first
    haystack_units: int = 0
    answers: list = field(default_factory=list)
    counted_tokens: int = 0

    @property
    def sha(self) -> str:
        return prompt_sha(self.input_ids)


def answer_tokens(tokenizer, samples, max_new_tokens) -> int:
    """New tokens enough to read the answers of ``samples``: the longest continuation
    ``" {a1}, {a2}."`` (the answers after the answer prefix) in tokens, plus :data:`ANSWER_MARGIN`,
    at most ``max_new_tokens`` (one 7-digit number in bytes: 9 + 2 = 11)."""
    if not samples:
        raise ValueError("answer_tokens: no samples")
    need = max(len(tokenizer.encode(" " + ", ".join(s.answers) + ".")) for s in samples)
    return min(int(max_new_tokens), need + ANSWER_MARGIN)


def _answer_list(answers) -> list:
    return [answers] if isinstance(answers, str) else list(answers)


def answer_fraction(prediction: str, answers) -> float:
    """Share of ``answers`` (a string or a list) that appear in ``prediction``, case-insensitive:
    RULER's ``string_match_all`` for one sample."""
    refs = _answer_list(answers)
    if not refs:
        raise ValueError("answer_fraction: no answers")
    pred = prediction.lower()
    return sum(1.0 if r.lower() in pred else 0.0 for r in refs) / len(refs)


def score(prediction: str, answer) -> bool:
    """RULER's string match: every answer (a string or a list) appears in the prediction
    (case-insensitive)."""
    return answer_fraction(prediction, answer) == 1.0


def string_match_all(preds, refs) -> float:
    """RULER's NIAH metric: mean over samples of :func:`answer_fraction`, in percent, 2 decimals."""
    return round(sum(answer_fraction(p, r) for p, r in zip(preds, refs, strict=True)) / len(preds) * 100, 2)


def string_match_part(preds, refs) -> float:
    """RULER's QA metric: share of samples with at least one answer found, in percent, 2 decimals."""
    return round(sum(answer_fraction(p, r) > 0 for p, r in zip(preds, refs, strict=True)) / len(preds) * 100, 2)
