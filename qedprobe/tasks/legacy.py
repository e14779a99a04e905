"""qedprobe's earlier NIAH format (``legacy``): the one the shipped checkpoints were trained and
evaluated on (their ``config.json`` records ``task_format``).

Legacy tasks (``TASKS``):

* ``s-niah-1``: haystack of the repeated noise text, one needle with a 7-digit number.
* ``s-niah-2``: prose haystack (a text file), one needle with a 7-digit number.
* ``s-niah-3``: prose haystack, one needle with a UUID.
* ``mk-niah``: prose haystack (as RULER's MK-NIAH-1; ``haystack="noise"`` for the noise text),
  ``num_needles`` (default 4) needles with distinct keys and numbers; one of them is asked, the
  others are the interference.

A prompt is::

    [BOS] {intro}\\n{haystack with the needle(s)}\\n{question} {answer prefix}

and the model must continue with the value; the score (as RULER's) is whether the value appears in
the greedy continuation (case-insensitive).

Lengths are in the tokenizer's tokens: ``len(input_ids) + max_new_tokens <= length`` for every
sample (the generated tokens count against the budget, as in RULER). The haystack is cut at
sentence boundaries, so a prompt is at most one sentence shorter than the budget.

Determinism: sample ``i`` of ``(task, length, seed, samples)`` depends on nothing else (not on the
strength, the batch, or the order of generation); its random numbers come from
``random.Random("task|seed|length|i")``, which is stable across Python runs. The depth of the
(asked) needle is ``i / (samples - 1)`` (0 = start of the haystack, 1 = end): depths are spread
evenly over the samples.
"""
from __future__ import annotations

import functools
import random
import re
import uuid

from qedprobe.tokenizer import load_tokenizer

from .sample import Sample, answer_tokens, default_prose_path

__all__ = ["NOISE_TEXT", "TASKS", "NIAHTask"]

NOISE_TEXT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""The noise haystack of S-NIAH-1, repeated."""

TASKS = ("s-niah-1", "s-niah-2", "s-niah-3", "mk-niah")

NEEDLE = "One of the special magic {kind}s for {key} is: {value}."
QUESTION = "What is the special magic {kind} for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic {kind} for {key} mentioned in the provided text is"
INTRO_ONE = ("A special magic {kind} is hidden somewhere in the text below. "
             "Read carefully and remember it: you will be asked for it at the end.")
INTRO_MANY = ("Several special magic {kind}s are hidden in the text below, each for a different key. "
              "Read carefully and remember them: you will be asked for one of them at the end.")

# Key words: "{adjective}-{noun}", written for this project.
_ADJECTIVES = (
    "amber", "ancient", "bitter", "bold", "brave", "bright", "broad", "calm", "clever", "cold",
    "crisp", "curious", "damp", "dark", "distant", "dusty", "eager", "early", "fancy", "fierce",
    "flat", "fresh", "gentle", "giant", "golden", "grand", "green", "hidden", "hollow", "humble",
    "icy", "jolly", "kind", "late", "lazy", "little", "lively", "loud", "lucky", "mellow",
    "misty", "modest", "narrow", "noble", "odd", "pale", "patient", "plain", "polite", "proud",
    "quick", "quiet", "rapid", "rare", "rough", "round", "rusty", "shallow", "sharp", "shy",
    "silent", "silver", "simple", "sleepy", "slow", "small", "smooth", "soft", "solid", "sour",
    "steady", "steep", "stormy", "sturdy", "sunny", "sweet", "swift", "tall", "tender", "thick",
    "tidy", "tiny", "vast", "velvet", "warm", "wary", "wild", "windy", "wise", "young",
)
_NOUNS = (
    "anchor", "apple", "arch", "badger", "barrel", "basket", "beacon", "bell", "bench", "birch",
    "blanket", "boat", "bottle", "bridge", "brook", "bucket", "cabin", "candle", "canyon", "castle",
    "cedar", "chair", "chimney", "clock", "cloud", "compass", "copper", "cottage", "crane", "creek",
    "desk", "dolphin", "drum", "eagle", "falcon", "feather", "fence", "ferry", "field", "fig",
    "flute", "forest", "fountain", "garden", "gate", "glacier", "harbor", "hammer", "harp", "hazel",
    "helmet", "hill", "island", "jacket", "kettle", "ladder", "lantern", "lemon", "lily", "meadow",
    "mirror", "mountain", "needle", "oak", "orchard", "otter", "paddle", "pebble", "pepper", "piano",
    "pillow", "pine", "planet", "pond", "quarry", "rabbit", "river", "robin", "saddle", "sailor",
    "shell", "shovel", "spoon", "squirrel", "stone", "table", "teapot", "thistle", "tower", "tulip",
    "valley", "violin", "wagon", "walnut", "whistle", "willow", "window", "wolf", "yacht", "zebra",
)

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@functools.lru_cache(maxsize=8)
def _read_sentences(path: str) -> tuple:
    if path == "<default>":
        text = default_prose_path().read_text(encoding="utf-8")
    else:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except UnicodeDecodeError as err:
            raise ValueError(f"`haystack_file` {path!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    sentences = tuple(s.strip() for s in _SENTENCE_END.split(" ".join(text.split())) if s.strip())
    if not sentences:
        raise ValueError(f"haystack file {path!r} has no text")
    return sentences


class NIAHTask:
    """Generator of one NIAH task for one tokenizer.

    Args:
        name: one of :data:`TASKS`.
        tokenizer: ``"bytes"``, a local HF tokenizer folder, or a tokenizer object.
        haystack_file: UTF-8 prose file for the prose haystacks (default: the shipped text);
            refused with the noise haystack, which does not read it.
        num_needles: needles in ``mk-niah`` (default 4); 1 for the single-needle tasks.
        haystack: ``"noise"`` or ``"prose"`` (only ``mk-niah`` may choose; default prose).
        max_new_tokens: generation budget, >= 1 (default 16 for numbers, 48 for UUIDs).
    """

    format = "legacy"

    def __init__(self, name, tokenizer="bytes", *, haystack_file=None, num_needles=None,
                 haystack=None, max_new_tokens=None):
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
        self.name = name
        self.tokenizer = load_tokenizer(tokenizer)
        default_hay = {"s-niah-1": "noise", "s-niah-2": "prose", "s-niah-3": "prose", "mk-niah": "prose"}[name]
        if haystack is not None and name != "mk-niah" and haystack != default_hay:
            raise ValueError(f"task {name} uses the {default_hay} haystack (only mk-niah takes `haystack`)")
        self.haystack = haystack or default_hay
        if self.haystack not in ("noise", "prose"):
            raise ValueError(f"haystack must be 'noise' or 'prose', got {self.haystack!r}")
        self.kind = "uuid" if name == "s-niah-3" else "number"
        if name == "mk-niah":
            self.num_needles = 4 if num_needles is None else int(num_needles)
            if self.num_needles < 2:
                raise ValueError("mk-niah needs `num_needles` >= 2")
        else:
            if num_needles not in (None, 1):
                raise ValueError(f"{name} has exactly one needle (`num_needles` is for mk-niah)")
            self.num_needles = 1
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                           or max_new_tokens < 1):
            raise ValueError(f"`max_new_tokens` must be an int >= 1, got {max_new_tokens!r}")
        self.max_new_tokens = max_new_tokens or (48 if self.kind == "uuid" else 16)
        if haystack_file is not None and self.haystack != "prose":
            raise ValueError(f"`haystack_file` is only read by the prose haystack; {name} uses the "
                             f"{self.haystack} haystack")
        self.haystack_file = None
        if self.haystack == "prose":
            self.haystack_file = "<default>" if haystack_file is None else str(haystack_file)
            self._sentences = _read_sentences(self.haystack_file)
        else:
            self._sentences = tuple(s.strip() for s in _SENTENCE_END.split(NOISE_TEXT))
        self._costs = {}

    # ----------------------------------------------------------------------------- pieces
    def describe(self) -> dict:
        """What defines the samples (written to a sweep's config, checked on resume)."""
        return {"format": self.format, "task": self.name, "tokenizer": self.tokenizer.name, "haystack": self.haystack,
                "haystack_file": self.haystack_file, "num_needles": self.num_needles,
                "max_new_tokens": self.max_new_tokens}

    def _value(self, rng):
        if self.kind == "uuid":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return str(rng.randint(1_000_000, 9_999_999))

    def _keys(self, rng, n):
        keys = set()
        out = []
        while len(out) < n:
            k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
            if k not in keys:
                keys.add(k)
                out.append(k)
        return out

    def _draw(self, rng, depth):
        """Keys, values and depths of the needles; the asked needle first."""
        n = self.num_needles
        keys = self._keys(rng, n)
        values = []
        while len(values) < n:
            v = self._value(rng)
            if v not in values:
                values.append(v)
        depths = [depth] + [rng.random() for _ in range(n - 1)]
        offset = rng.randrange(len(self._sentences)) if self.haystack == "prose" else 0
        return list(zip(keys, values, depths)), offset

    def _build(self, needles, offset, n_units):
        """The prompt text with ``n_units`` haystack sentences (cycled from ``offset``)."""
        sents = self._sentences
        hay = [sents[(offset + j) % len(sents)] for j in range(n_units)]
        # insertion slots: needle with depth x goes before sentence round(x * n_units)
        inserts = {}
        for key, value, depth in needles:
            pos = min(n_units, max(0, int(round(depth * n_units))))
            inserts.setdefault(pos, []).append(NEEDLE.format(kind=self.kind, key=key, value=value))
        parts = []
        for j in range(n_units + 1):
            parts.extend(inserts.get(j, ()))
            if j < n_units:
                parts.append(hay[j])
        asked_key = needles[0][0]
        intro = (INTRO_MANY if self.num_needles > 1 else INTRO_ONE).format(kind=self.kind)
        question = QUESTION.format(kind=self.kind, key=asked_key)
        prefix = ANSWER_PREFIX.format(kind=self.kind, key=asked_key)
        return f"{intro}\n{' '.join(parts)}\n{question} {prefix}"

    def _ids(self, text):
        ids = self.tokenizer.encode(text)
        bos = self.tokenizer.bos_id
        return ([bos] if bos is not None else []) + ids

    def _budget(self, length):
        return int(length) - self.max_new_tokens

    def _unit_cost(self, j):
        """Tokens of haystack sentence ``j`` when it follows a space (cached)."""
        cost = self._costs.get(j)
        if cost is None:
            cost = self._costs[j] = len(self.tokenizer.encode(" " + self._sentences[j]))
        return cost

    def _fit(self, needles, offset, budget):
        """Most haystack sentences such that the prompt fits ``budget`` tokens: predicted from
        per-sentence token counts, then checked (and corrected) on the whole prompt."""
        ids0 = self._ids(self._build(needles, offset, 0))
        if len(ids0) > budget:
            return None, None
        S = len(self._sentences)
        total, n = len(ids0), 0
        while True:
            c = self._unit_cost((offset + n) % S)
            if total + c > budget:
                break
            total += c
            n += 1
        ids = self._ids(self._build(needles, offset, n))
        while len(ids) > budget and n > 0:  # tokenization is not exactly additive
            excess = len(ids) - budget
            drop, acc = 0, 0
            while acc < excess and drop < n:
                acc += self._unit_cost((offset + n - 1 - drop) % S)
                drop += 1
            n -= max(1, drop)
            ids = self._ids(self._build(needles, offset, n))
        return n, ids

    def answer_tokens(self, samples) -> int:
        """New tokens enough to read the answers of ``samples`` (:func:`answer_tokens`)."""
        return answer_tokens(self.tokenizer, samples, self.max_new_tokens)

    def min_length(self) -> int:
        """A length every sample fits in: an empty haystack and, for every needle, the key of the
        most tokens (keys are the only part whose length varies), so ``sample(min_length(), i)``
        never fails."""
        rng = random.Random(f"{self.name}|calibrate|min")
        needles, offset = self._draw(rng, 0.5)
        ntok = lambda word: len(self.tokenizer.encode(word))  # noqa: E731
        longest = f"{max(_ADJECTIVES, key=ntok)}-{max(_NOUNS, key=ntok)}"
        needles = [(longest, value, depth) for _, value, depth in needles]
        return len(self._ids(self._build(needles, offset, 0))) + self.max_new_tokens + 8

    # ----------------------------------------------------------------------------- samples
    def sample(self, length: int, i: int, *, samples: int, seed: int = 0) -> Sample:
        """Sample ``i`` (0-based) of ``samples`` at ``length`` tokens."""
        length, i, samples = int(length), int(i), int(samples)
        if not 0 <= i < samples:
            raise ValueError(f"sample id {i} outside 0..{samples - 1}")
        depth = i / (samples - 1) if samples > 1 else 0.5
        rng = random.Random(f"{self.name}|{seed}|{length}|{i}")
        needles, offset = self._draw(rng, depth)
        n_units, ids = self._fit(needles, offset, self._budget(length))
        if ids is None:
            raise ValueError(f"length {length} is too short for task {self.name}: the question, "
                             f"needle(s) and {self.max_new_tokens} new tokens do not fit")
        text = self._build(needles, offset, n_units)
        key, value, _ = needles[0]
        return Sample(task=self.name, length=length, sample_id=i, seed=int(seed), prompt=text,
                      input_ids=ids, answer=value, key=key, depth=depth,
                      max_new_tokens=self.max_new_tokens, needles=[list(n) for n in needles],
                      haystack_units=n_units, answers=[value], counted_tokens=len(ids) + self.max_new_tokens)

    def samples(self, length: int, samples: int, *, seed: int = 0, ids=None):
        """Samples ``ids`` (default all) at ``length``, as a list."""
        ids = range(samples) if ids is None else ids
        return [self.sample(length, i, samples=samples, seed=seed) for i in ids]


