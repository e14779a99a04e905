r"""The training mixture: NIAH documents from :mod:`qedprobe.eval.tasks`, packed into rows.

A *document* is an evaluation-style prompt followed by its answer::

    [BOS] {intro}\n{haystack with needle(s)}\n{question} {answer prefix} {value}.[EOS]

built by :class:`qedprobe.eval.tasks.NIAHTask` in the ``legacy`` task format
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
``random.Random("task|seed|length|i")`` (see ``qedprobe.eval.tasks``), so training and evaluation
draw keys, values and haystack offsets from different seed streams (``tests/test_train.py``
checks that no prompt and no asked (key, value) pair is shared). The haystack texts (the noise
sentences and the shipped prose file) are shared: they are the filler, not the answer.

Targets are the next tokens; the batch carries two masks over targets: ``valid`` (not PAD) and
``answer`` (the value's tokens, what RULER scores).
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import torch

from qedprobe.eval.tasks import make_task
from qedprobe.tokenizer import load_tokenizer

TASK_FORMAT = "legacy"
"""The task format of the training documents (recorded in the model's ``config.json``)."""

SAMPLE_SPACE = 10**9
"""Sample indices are drawn from ``range(SAMPLE_SPACE)``; the needle depth is ``i / (SAMPLE_SPACE - 1)``."""


@dataclass(frozen=True)
class Component:
    """One part of a mixture: a task of ``qedprobe.eval.tasks.TASKS``, its sampling weight, the
    haystack (``mk-niah`` only: ``"noise"`` or ``"prose"``) and the inclusive needle-count range."""

    task: str
    weight: float
    haystack: str | None = None
    needles: tuple[int, int] = (1, 1)


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
}


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
        self._tasks = {}  # (component index, needles) -> (NIAHTask, min_length)
        for c, comp in enumerate(self.components):
            for n in range(comp.needles[0], comp.needles[1] + 1):
                task = make_task(comp.task, self.tokenizer, format=TASK_FORMAT, haystack=comp.haystack,
                                 num_needles=n if comp.task == "mk-niah" else None)
                need = task.min_length()
                if need > seq_len + 1:
                    raise ValueError(f"TrainData: `seq_len` {seq_len} is too short for mixture "
                                     f"{mixture!r}: {comp.task} with {n} needle(s) needs {need - 1}")
                self._tasks[c, n] = (task, need)

    def describe(self) -> dict:
        """The data recipe (for model cards and resume checks)."""
        return {"task_format": TASK_FORMAT, "mixture": self.mixture, "components": [asdict(c) for c in self.components],
                "seq_len": self.seq_len, "seed": self.seed, "niah_seed": niah_seed(self.seed),
                "tokenizer": self.tokenizer.name, "packing": "whole documents per row, PAD after"}

    def _document(self, rng: random.Random, space: int) -> tuple[list[int], list[bool]] | None:
        """One document of at most ``space`` tokens and its answer mask; None if none fits."""
        fits = [(c, n) for (c, n), (_, need) in self._tasks.items() if need <= space]
        if not fits:
            return None
        comps = sorted({c for c, _ in fits})
        c = rng.choices(comps, weights=[self.components[i].weight for i in comps])[0]
        n = rng.choice([m for i, m in fits if i == c])
        task, need = self._tasks[c, n]
        length = round(math.exp(rng.uniform(math.log(need), math.log(space))))
        if space - length < min(need for _, need in self._tasks.values()):
            length = space
        sample = task.sample(length, rng.randrange(SAMPLE_SPACE), samples=SAMPLE_SPACE,
                             seed=niah_seed(self.seed))
        answer = self.tokenizer.encode(" " + sample.answer)
        tail = self.tokenizer.encode(".") + [self.tokenizer.eos_id]
        ids = list(sample.input_ids) + answer + tail
        if len(ids) > length:
            raise ValueError(f"TrainData: the answer of {task.name} takes more tokens than its "
                             f"max_new_tokens ({task.max_new_tokens}) for tokenizer {self.tokenizer!r}")
        mask = [False] * len(sample.input_ids) + [True] * len(answer) + [False] * len(tail)
        return ids, mask

    def row(self, index: int) -> tuple[list[int], list[bool]]:
        """Row ``index``: ``seq_len + 1`` token ids and the answer mask (same length)."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"TrainData.row: `index` must be an int >= 0, got {index!r}")
        rng = random.Random(f"qedprobe-train|{self.mixture}|{self.seed}|{self.seq_len}|{index}")
        ids, mask = [], []
        while (doc := self._document(rng, self.seq_len + 1 - len(ids))) is not None:
            ids += doc[0]
            mask += doc[1]
        pad = self.seq_len + 1 - len(ids)
        return ids + [self.tokenizer.pad_id] * pad, mask + [False] * pad

    def rows(self, start: int, count: int) -> dict[str, torch.Tensor]:
        """Rows ``start .. start + count - 1`` as tensors (``T = seq_len``):

        ``input_ids`` ``[count, T]`` int64, ``targets`` ``[count, T]`` int64 (inputs shifted by one),
        ``valid`` ``[count, T]`` bool (target is not PAD), ``answer`` ``[count, T]`` bool
        (target is a token of an answer value).
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"TrainData.rows: `count` must be an int >= 1, got {count!r}")
        built = [self.row(start + i) for i in range(count)]
        ids = torch.tensor([r[0] for r in built], dtype=torch.int64)
        answer = torch.tensor([r[1] for r in built], dtype=torch.bool)
        targets = ids[:, 1:]
        return {"input_ids": ids[:, :-1], "targets": targets,
                "valid": targets != self.tokenizer.pad_id, "answer": answer[:, 1:]}
