r"""The training mixture: NIAH documents from :mod:`qedprobe.tasks`, packed into rows.

A *document* is an evaluation-style prompt followed by its answer::

    [BOS] {intro}\n{haystack with needle(s)}\n{question} {answer prefix} {value}.[EOS]

built by :class:`qedprobe.tasks.NIAHTask` in the ``legacy`` task format
(:data:`TASK_FORMAT`; the same generator ``--format legacy`` evaluates, so the format the model
learns is the format it is tested on; RULER's format draws its samples as one stream per length,
not by index, so it cannot feed random rows) and the tokenizer of
:mod:`qedprobe.tokenizer` (bytes by default: ids 0-255, BOS 256, EOS 257, PAD 258).

A *row* holds ``seq_len + 1`` tokens: whole documents, back to back, then PAD. Documents are
never cut, so every answer can be retrieved from its own row. For row ``r`` the generator
``random.Random("qedprobe-train|{mixture}|{seed}|{seq_len}|{r}")`` draws, while space is left:
a component (by weight, among those that still fit), a needle count, a document length
``L`` log-uniform in ``[min_length, space]`` (the whole space when less than one more document
would fit after it) and a sample index. Row ``r`` therefore depends on nothing but
``(mixture, seed, seq_len, r)``: step ``s`` of a run with ``R`` rows per step reads rows
``s*R .. s*R + R - 1``, which is all a resumed run needs to know about the data position.

Disjointness from evaluation: training documents call ``NIAHTask.sample(..., seed=-(1 + seed))``,
a negative seed, while evaluation sweeps use seeds ``>= 0``. A sample's random numbers come from
``random.Random("task|seed|length|i")`` (see ``qedprobe.tasks``), so training and evaluation
draw keys, values and haystack offsets from different seed streams (``tests/test_train.py``
checks that no prompt and no asked (key, value) pair is shared). The haystack texts (the noise
sentences and the shipped prose file) are shared: they are the filler, not the answer.

Multi-query documents (MK-NIAH components with ``queries`` other than ``"one"``): after the
sample's own question and answer come ``num_needles - 1`` more query lines and answers, each
query line being the sample's last prompt line (question and answer prefix) with the asked key
replaced (:func:`qedprobe.tasks.control.query_line`)::

    ... {question(k0)} {prefix(k0)} {v0}.\n{question(k3)} {prefix(k3)} {v3}.\n ... [EOS]

so one haystack supervises many key-value pairs (dense supervision, as in multi-query
associative recall). ``queries="all"`` asks every other needle once, in a random order; that
lets a model answer later queries by elimination (the values not given yet) without matching
any key, and the last one is determined outright. ``queries="random"`` asks needles drawn
uniformly with replacement, so earlier answers say nothing about the next asked key. The sample
is drawn that many query lines shorter, so the document still fits its length.

Targets are the next tokens; the batch carries three masks over targets: ``valid`` (not PAD),
``answer`` (the value's tokens, what RULER scores) and ``key`` (the *key-dependent* answer
tokens, :func:`key_tokens`: those where more than one needle value of the document is still
consistent with the answer so far, i.e. where the model has to match the asked key; once they
are written, the rest of the value is a copy). With a few needles of random 7-digit numbers
that is mostly the first digit; single-needle documents have none.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict

import torch

from qedprobe.tasks.control import query_line
from qedprobe.tasks import make_task
from qedprobe.tokenizer import load_tokenizer

from .mixtures import MIXTURES

TASK_FORMAT = "legacy"
"""The task format of the training documents (recorded in the model's ``config.json``)."""

QUERY_SLACK = 16
"""Tokens reserved per extra query line beyond the calibration line (keys differ in length)."""
SAMPLE_SPACE = 10**9
"""Sample indices are drawn from ``range(SAMPLE_SPACE)``; the needle depth is ``i / (SAMPLE_SPACE - 1)``."""


def key_tokens(tokenizer, ids: list[int], values: list[str]) -> list[bool]:
    """For the answer tokens ``ids`` (of one of ``values``): True where the token adds characters
    to the value and more than one of ``values`` starts with the value written before it."""
    mask = []
    for j in range(len(ids)):
        before, after = tokenizer.decode(ids[:j]).strip(), tokenizer.decode(ids[:j + 1]).strip()
        mask.append(after != before and sum(v.startswith(before) for v in values) > 1)
    return mask


def niah_seed(seed: int) -> int:
    """The (negative) ``NIAHTask.sample`` seed of training seed ``seed``; evaluation uses seeds >= 0."""
    return -1 - int(seed)


class TrainData:
    """Deterministic rows of packed NIAH documents.

    Args:
        seq_len: tokens per row fed to the model (a row holds ``seq_len + 1`` for the shift).
        mixture: a key of :data:`MIXTURES`.
        seed: data seed (any int >= 0); also selects the NIAH seed stream :func:`niah_seed`.
        tokenizer: ``"bytes"`` or anything :func:`qedprobe.tokenizer.load_tokenizer` accepts;
            it must have BOS, EOS and PAD ids.
    """

    def __init__(self, seq_len: int, mixture: str = "niah", seed: int = 0, tokenizer="bytes"):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"TrainData: `seq_len` must be an int >= 2, got {seq_len!r}")
        if mixture not in MIXTURES:
            raise ValueError(f"TrainData: `mixture` must be one of {sorted(MIXTURES)}, got {mixture!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"TrainData: `seed` must be an int >= 0, got {seed!r}")
        self.tokenizer = load_tokenizer(tokenizer)
        for name in ("bos_id", "eos_id", "pad_id"):
            if getattr(self.tokenizer, name, None) is None:
                raise ValueError(f"TrainData: `tokenizer` {self.tokenizer!r} has no {name}")
        self.seq_len, self.mixture, self.seed = seq_len, mixture, seed
        self.components = MIXTURES[mixture]
        self._tasks = {}  # (component index, needles) -> (NIAHTask, min_length, tokens per extra query)
        for c, comp in enumerate(self.components):
            for n in range(comp.needles[0], comp.needles[1] + 1):
                task = make_task(comp.task, self.tokenizer, format=TASK_FORMAT, haystack=comp.haystack,
                                 num_needles=n if comp.task == "mk-niah" else None)
                reserve = self._query_reserve(task) if comp.queries != "one" else 0
                need = task.min_length() + (n - 1) * reserve
                if need > seq_len + 1:
                    raise ValueError(f"TrainData: `seq_len` {seq_len} is too short for mixture "
                                     f"{mixture!r}: {comp.task} with {n} needle(s) needs {need - 1}")
                self._tasks[c, n] = (task, need, reserve)

    def _query_reserve(self, task) -> int:
        """Tokens enough for one more query line and its answer: a calibration sample's line,
        ``max_new_tokens`` and :data:`QUERY_SLACK`."""
        probe = task.sample(task.min_length(), 0, samples=1, seed=niah_seed(self.seed))
        line = self.tokenizer.encode("\n" + query_line(probe, probe.key))
        return len(line) + task.max_new_tokens + QUERY_SLACK

    def describe(self) -> dict:
        """The data recipe (for model cards and resume checks)."""
        return {"task_format": TASK_FORMAT, "mixture": self.mixture, "components": [asdict(c) for c in self.components],
                "seq_len": self.seq_len, "seed": self.seed, "niah_seed": niah_seed(self.seed),
                "tokenizer": self.tokenizer.name, "packing": "whole documents per row, PAD after"}

    def _document(self, rng: random.Random, space: int) -> tuple[list[int], list[bool], list[bool]] | None:
        """One document of at most ``space`` tokens with its answer and key masks; None if none fits."""
        fits = [(c, n) for (c, n), (_, need, _) in self._tasks.items() if need <= space]
        if not fits:
            return None
        comps = sorted({c for c, _ in fits})
        c = rng.choices(comps, weights=[self.components[i].weight for i in comps])[0]
        n = rng.choice([m for i, m in fits if i == c])
        task, need, reserve = self._tasks[c, n]
        length = round(math.exp(rng.uniform(math.log(need), math.log(space))))
        if space - length < min(need for _, need, _ in self._tasks.values()):
            length = space
        sample = task.sample(length - (n - 1) * reserve, rng.randrange(SAMPLE_SPACE), samples=SAMPLE_SPACE,
                             seed=niah_seed(self.seed))
        values = [value for _, value, _ in sample.needles]
        ids, answer, key = list(sample.input_ids), [False] * len(sample.input_ids), [False] * len(sample.input_ids)
        asked = [sample.needles[0]]
        queries = self.components[c].queries
        if queries == "all":
            others = sample.needles[1:]
            asked += rng.sample(others, len(others))
        elif queries == "random":
            asked += [rng.choice(sample.needles) for _ in range(n - 1)]
        for q, (k, value, _) in enumerate(asked):
            if q:
                line = self.tokenizer.encode("\n" + query_line(sample, k))
                ids, answer, key = ids + line, answer + [False] * len(line), key + [False] * len(line)
            value_ids = self.tokenizer.encode(" " + value)
            dot = self.tokenizer.encode(".")
            ids += value_ids + dot
            answer += [True] * len(value_ids) + [False] * len(dot)
            key += key_tokens(self.tokenizer, value_ids, values) + [False] * len(dot)
        ids.append(self.tokenizer.eos_id)
        answer.append(False)
        key.append(False)
        if len(ids) > length:
            raise ValueError(f"TrainData: a {task.name} document takes {len(ids)} tokens, more than its "
                             f"length {length} (answers longer than max_new_tokens ({task.max_new_tokens}), "
                             f"or query lines longer than reserved) for tokenizer {self.tokenizer!r}")
        return ids, answer, key

    def row(self, index: int) -> tuple[list[int], list[bool], list[bool]]:
        """Row ``index``: ``seq_len + 1`` token ids, the answer mask and the key mask (same length)."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"TrainData.row: `index` must be an int >= 0, got {index!r}")
        rng = random.Random(f"qedprobe-train|{self.mixture}|{self.seed}|{self.seq_len}|{index}")
        ids, answer, key = [], [], []
        while (doc := self._document(rng, self.seq_len + 1 - len(ids))) is not None:
            ids += doc[0]
            answer += doc[1]
            key += doc[2]
        pad = self.seq_len + 1 - len(ids)
        return ids + [self.tokenizer.pad_id] * pad, answer + [False] * pad, key + [False] * pad

    def rows(self, start: int, count: int) -> dict[str, torch.Tensor]:
        """Rows ``start .. start + count - 1`` as tensors (``T = seq_len``):

        ``input_ids`` ``[count, T]`` int64, ``targets`` ``[count, T]`` int64 (inputs shifted by one),
        ``valid`` ``[count, T]`` bool (target is not PAD), ``answer`` ``[count, T]`` bool
        (target is a token of an answer value), ``key`` ``[count, T]`` bool (a key-dependent
        answer token, :func:`key_tokens`).
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"TrainData.rows: `count` must be an int >= 1, got {count!r}")
        built = [self.row(start + i) for i in range(count)]
        ids = torch.tensor([r[0] for r in built], dtype=torch.int64)
        answer = torch.tensor([r[1] for r in built], dtype=torch.bool)
        key = torch.tensor([r[2] for r in built], dtype=torch.bool)
        targets = ids[:, 1:]
        return {"input_ids": ids[:, :-1], "targets": targets, "valid": targets != self.tokenizer.pad_id,
                "answer": answer[:, 1:], "key": key[:, 1:]}
