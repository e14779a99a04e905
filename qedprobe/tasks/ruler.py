r"""RULER's NIAH tasks, reproduced: the ``ruler`` task format.

This is NVIDIA RULER's needle-in-a-haystack generator (``scripts/data/synthetic/niah.py``,
``constants.py``, ``scripts/synthetic.yaml`` and ``scripts/eval/synthetic/constants.py`` at
commit :data:`RULER_COMMIT`), re-implemented from a reading of its source: given the same
tokenizer, haystack text and seed, sample ``i`` has RULER's prompt character for character and
RULER's answers (``tests/test_eval_ruler.py`` checks this against fixtures made by running
RULER's own script, ``tests/fixtures/make_ruler_fixtures.py``). What RULER does, and so what this
module does:

* **Tasks** (:data:`RULER_TASKS`, RULER's ``synthetic.yaml``): ``niah_single_1/2/3``,
  ``niah_multikey_1/2/3``, ``niah_multivalue``, ``niah_multiquery``; each fixes the haystack
  (``noise``, ``essay`` or ``needle``), the key and value kinds (``words``, ``numbers``,
  ``uuids``) and the numbers of keys, values per key and asked keys.
* **Prompt**: the template ``Some special magic {numbers} are hidden within the following text.
  Make sure to memorize it. I will quiz you about the {numbers} afterwards.\n{context}\nWhat are all
  the special magic {numbers} for {query} mentioned in the provided text?`` followed by the answer
  prefix `` The special magic {numbers} for {query} mentioned in the provided text are`` (RULER's
  ``base`` model template: no chat wrapper). When one value is asked (``num_needle_q *
  num_needle_v == 1``, which includes ``niah_multikey_*``) RULER rewrites it to the singular by
  string replacement ("Some" -> "A", "are all"/"are" -> "is", "numbers" -> "number").
* **Chat template** (``chat_template=True``, off by default): the task text becomes the user's
  turn of the tokenizer's own chat template with the assistant's turn opened
  (``apply_chat_template(..., add_generation_prompt=True)``), and the answer prefix follows it, as
  RULER places the answer prefix after a chat model's template. The template's tokens count
  against the length, as in RULER; no BOS is prepended (the template writes the special tokens
  its model expects). RULER ships fixed template strings per model family and applies its
  singular rewrite to the whole templated text; here the tokenizer's own template wraps the
  already rewritten task text.
* **Context**: ``noise`` repeats the whole five-sentence block, one block per line, each needle on
  a line of its own at a random line; ``needle`` is lines of distractor needles (random keys and
  values); ``essay`` is the first words of the essay text (cycled when short), split into
  sentences, with the needles between sentences at depths drawn from 40 evenly spaced depths
  (:data:`DEPTHS`, without replacement), joined by single spaces.
* **Keys**: adjective-noun pairs from wonderwords' word lists (RULER's ``words``), 7-digit numbers,
  or UUID4s from the same random stream.
* **Length budget**: ``len(tokenizer.encode(prompt)) + 128 <= length``: RULER counts its 128
  generated tokens against the length and counts the prompt without special tokens; the BOS
  token (when the tokenizer has one, and no chat template is used) is prepended to the model's
  input, as a Hugging Face tokenizer does when RULER calls the model, and is not counted. The
  number of haystack units comes from RULER's binary search at each length; a sample that does
  not fit is redrawn with ``incremental`` fewer units (500 words for essays; 25 lines, or 5 below
  4096 tokens, otherwise).
* **Random stream**: RULER seeds Python's ``random`` once (``--random_seed``, 42 in RULER's
  scripts) and draws everything from it in order: the estimate, the binary search, then sample 0,
  1, ...; so sample ``i`` at ``(length, seed)`` depends on the samples before it. This module
  replays that stream (and keeps the generator states, so samples come back in any order).
* **Scoring** (RULER's ``string_match_all`` for every NIAH task): the fraction of the answers
  that appear in the prediction (case-insensitive), averaged and reported in percent.

Deliberate differences, all outside the prompt text: RULER's ``essay`` haystack is Paul Graham's
essays, which are not redistributable; the default here is the prose shipped with qedprobe (a
stand-in: ``haystack_file=`` takes RULER's ``PaulGrahamEssays.json``, a text file or a folder of
``.txt`` files). RULER splits essays with nltk's punkt model, which needs a data download;
:func:`split_sentences` is a rule-based splitter that agrees with punkt on plain prose (sentence
ends at ``. ! ?`` before whitespace) and keeps common abbreviations and initials inside a
sentence; on text where the two disagree a needle can land one sentence boundary away from
where RULER puts it. Where RULER would retry forever (the smallest haystack never fits) this
module raises a ``ValueError`` that names the length.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import importlib.metadata
import json
import random
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from wonderwords import Defaults, RandomWord

from qedprobe.tokenizer import TokenizerError, chat_prompt, load_tokenizer

from .sample import Sample, answer_tokens, default_prose_path

__all__ = [
    "ANSWER_PREFIX",
    "DEPTHS",
    "NEEDLE",
    "NOISE",
    "RULER_COMMIT",
    "RULER_TASKS",
    "TEMPLATE",
    "TOKENS_TO_GENERATE",
    "KeyWords",
    "RulerTask",
    "RulerTaskSpec",
    "read_essay",
    "split_sentences",
]

RULER_COMMIT = "c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a"
"""The NVIDIA/RULER commit this module reproduces."""

TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to "
            "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
            "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TOKENS_TO_GENERATE = 128
"""RULER's ``tokens_to_generate`` for NIAH: counted against the length, and the decode budget."""

DEPTHS = tuple(round(100 * k / 39) for k in range(40))
"""``np.round(np.linspace(0, 100, 40)).astype(int)``: the needle depths in percent (no value of
``100 k / 39`` is a tie, so Python's rounding gives numpy's)."""

MAX_RETRIES = 100
"""Redraws at the smallest haystack before a length is declared too short (RULER loops forever)."""

_SINGULAR = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))


@dataclass(frozen=True)
class RulerTaskSpec:
    """One task of RULER's ``synthetic.yaml``: haystack ``noise`` | ``essay`` | ``needle``; key
    and value kinds ``words`` | ``numbers`` | ``uuids``; keys, values per key, asked keys."""

    haystack: str
    type_needle_k: str
    type_needle_v: str
    num_needle_k: int = 1
    num_needle_v: int = 1
    num_needle_q: int = 1


RULER_TASKS = {
    "niah_single_1": RulerTaskSpec("noise", "words", "numbers"),
    "niah_single_2": RulerTaskSpec("essay", "words", "numbers"),
    "niah_single_3": RulerTaskSpec("essay", "words", "uuids"),
    "niah_multikey_1": RulerTaskSpec("essay", "words", "numbers", num_needle_k=4),
    "niah_multikey_2": RulerTaskSpec("needle", "words", "numbers"),
    "niah_multikey_3": RulerTaskSpec("needle", "uuids", "uuids"),
    "niah_multivalue": RulerTaskSpec("essay", "words", "numbers", num_needle_v=4),
    "niah_multiquery": RulerTaskSpec("essay", "words", "numbers", num_needle_q=4),
}


# ------------------------------------------------------------------------------- key words
class KeyWords:
    """``sorted(set(f"{adj}-{noun}" for adj in adjs for noun in nouns))`` as a lazy sequence.

    RULER builds this list (6.2M strings, seconds and ~0.8 GB) to call ``random.choice`` on it;
    ``random.choice`` only needs ``len`` and indexing. All strings of one adjective start with
    ``adj + "-"``; sorted by that prefix, the adjectives fall into runs that share the run's first
    prefix (``high-`` and ``high-pitched-``), and only within a run can strings of different
    adjectives interleave. A run of one adjective is that adjective before every sorted noun;
    longer runs are materialised (sorted, deduplicated). Indexing is a binary search over runs.
    """

    def __init__(self, adjectives, nouns):
        self._nouns = sorted(set(nouns))
        prefixes = sorted({a + "-" for a in adjectives})
        runs = []
        for p in prefixes:
            if runs and p.startswith(runs[-1][0]):
                runs[-1].append(p)
            else:
                runs.append([p])
        self._runs, self._starts, total = [], [], 0
        for run in runs:
            block = run[0] if len(run) == 1 else sorted({p + n for p in run for n in self._nouns})
            self._runs.append(block)
            self._starts.append(total)
            total += len(self._nouns) if len(run) == 1 else len(block)
        self._len = total

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < self._len:
            raise IndexError(i)
        r = bisect.bisect_right(self._starts, i) - 1
        block, j = self._runs[r], i - self._starts[r]
        return block + self._nouns[j] if isinstance(block, str) else block[j]


def wonderwords_lists() -> tuple[list[str], list[str]]:
    """``(adjectives, nouns)``: the installed wonderwords' default word lists, each sorted and
    without duplicates, through its public ``RandomWord.filter``. RULER reads the same two files
    line by line; :class:`KeyWords` sorts and deduplicates them, so the keys are RULER's."""
    words = RandomWord(enhanced_prefixes=False, adjective=Defaults.ADJECTIVES, noun=Defaults.NOUNS)
    return words.filter(include_categories=["adjective"]), words.filter(include_categories=["noun"])


@functools.lru_cache(maxsize=1)
def wonderwords_keys() -> KeyWords:
    """RULER's key words: adjective-noun pairs of :func:`wonderwords_lists`."""
    return KeyWords(*wonderwords_lists())


# --------------------------------------------------------------------------------- essays
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc inc ltd co corp dept univ approx e.g i.e u.s u.k a.m p.m".split())
_SENTENCE_END = re.compile(r"""[.!?]+["'”’)\]]*$""")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` (nltk ``sent_tokenize``'s role in RULER), whitespace between them dropped.

    A sentence ends after a whitespace-separated token that ends in ``.``, ``!`` or ``?`` (closing
    quotes or brackets may follow), unless that token is a common abbreviation (``Mr.``, ``e.g.``,
    ...) or a single-letter initial (``J.``). Tokens keep their inner whitespace.
    """
    out, start = [], None
    tokens = list(re.finditer(r"\S+", text))
    for j, m in enumerate(tokens):
        if start is None:
            start = m.start()
        tok = m.group()
        if j + 1 < len(tokens) and _SENTENCE_END.search(tok) and not _keeps_going(tok):
            out.append(text[start:m.end()])
            start = None
    if start is not None:
        out.append(text[start:tokens[-1].end()])
    return out


def _keeps_going(token: str) -> bool:
    """An abbreviation or an initial: its period does not end the sentence."""
    if not token.endswith("."):
        return False
    word = token[:-1].lower().lstrip("\"'“‘([")
    return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())


def read_essay(path=None) -> str:
    """The essay haystack text: ``path`` is RULER's ``PaulGrahamEssays.json`` (its ``"text"``), a
    folder of ``.txt`` files (concatenated in name order, as RULER's download script joins them)
    or any text file; ``None`` is the prose shipped with qedprobe (a stand-in for the essays)."""
    if path is None:
        return default_prose_path().read_text(encoding="utf-8")
    try:
        return _read_essay(Path(path))
    except UnicodeDecodeError as err:
        raise ValueError(f"`haystack_file` {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def _read_essay(p: Path) -> str:
    if p.is_dir():
        files = sorted(p.glob("*.txt"))
        if not files:
            raise ValueError(f"haystack folder {str(p)!r} has no .txt files")
        text = "".join(f.read_text(encoding="utf-8") for f in files)
    elif p.suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"haystack file {str(p)!r} is not valid JSON ({err})") from None
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            raise ValueError(f"haystack file {str(p)!r}: expected a JSON object with a \"text\" string "
                             "(RULER's PaulGrahamEssays.json)")
        text = data["text"]
    else:
        text = p.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"haystack {str(p)!r} has no text")
    return text


# ---------------------------------------------------------------------------------- tasks
@dataclass
class _Drawn:
    """One generated prompt before tokenization: text, answers, asked query, needles, units."""

    text: str
    answers: list
    query: str
    needles: list  # [key, value, depth] per needle, asked ones first
    units: int


class RulerTask:
    """RULER's NIAH task ``name`` for one tokenizer (see the module docstring).

    Args:
        name: a key of :data:`RULER_TASKS`.
        tokenizer: ``"bytes"``, a local HF tokenizer folder, or a tokenizer object.
        haystack_file: the essay haystack (``essay`` tasks only; see :func:`read_essay`).
        chat_template: wrap each prompt in the tokenizer's chat template (see the module
            docstring); a tokenizer without one is refused.
    """

    format = "ruler"
    max_new_tokens = TOKENS_TO_GENERATE

    def __init__(self, name, tokenizer="bytes", *, haystack_file=None, chat_template: bool = False):
        if name not in RULER_TASKS:
            raise ValueError(f"unknown RULER task {name!r}; choose one of {', '.join(RULER_TASKS)}")
        if not isinstance(chat_template, bool):
            raise ValueError(f"`chat_template` must be True or False, got {chat_template!r}")
        self.name, self.spec = name, RULER_TASKS[name]
        self.tokenizer = load_tokenizer(tokenizer)
        if chat_template:
            try:
                chat_prompt(self.tokenizer, "")
            except TokenizerError as exc:
                raise ValueError(f"`chat_template`: {exc}") from None
        self.chat_template = chat_template
        if haystack_file is not None and self.spec.haystack != "essay":
            raise ValueError(f"task {name} uses the {self.spec.haystack} haystack: a haystack file "
                             "applies to the essay tasks only")
        self.haystack_file = None if haystack_file is None else str(haystack_file)
        self._words = None
        if self.spec.haystack == "essay":
            self._words = re.sub(r"\s+", " ", read_essay(haystack_file)).split(" ")
        self._streams = {}  # (length, seed) -> _Stream

    def describe(self) -> dict:
        """What defines the samples (a sweep's ``samples_spec``)."""
        spec = {"format": self.format, "task": self.name, "tokenizer": self.tokenizer.name,
                "haystack": self.spec.haystack, "haystack_file": self.haystack_file,
                "max_new_tokens": self.max_new_tokens, "ruler_commit": RULER_COMMIT,
                "wonderwords": importlib.metadata.version("wonderwords")}
        if self.chat_template:  # absent when off: folders written before the option still resume
            spec["chat_template_sha256"] = hashlib.sha256(self.tokenizer.chat_template.encode()).hexdigest()
        return spec

    # ------------------------------------------------------------------------ one prompt
    def _random(self, rng, kind):
        if kind == "numbers":
            return str(rng.randint(10 ** 6, 10 ** 7 - 1))
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return rng.choice(wonderwords_keys())

    def _draw(self, rng, seed, units) -> _Drawn:
        """RULER's ``generate_input_output(units)``, drawing from ``rng`` in RULER's order."""
        spec = self.spec
        num_k = max(spec.num_needle_k, spec.num_needle_q)
        keys, values, needles = [], [], []  # needles: (key index, value)
        for k in range(num_k):
            keys.append(self._random(rng, spec.type_needle_k))
            values.append([])
            for _ in range(spec.num_needle_v):
                values[-1].append(self._random(rng, spec.type_needle_v))
                needles.append((k, values[-1][-1]))
        random.Random(seed).shuffle(needles)
        texts = [NEEDLE.format(type_needle_v=spec.type_needle_v, key=keys[k], value=v) for k, v in needles]
        context, depths = (self._essay_context(rng, units, texts) if spec.haystack == "essay"
                           else self._line_context(rng, units, texts))
        asked = rng.sample(range(num_k), spec.num_needle_q)
        queries = [keys[i] for i in asked]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, prefix, type_v = TEMPLATE, ANSWER_PREFIX, spec.type_needle_v
        if spec.num_needle_q * spec.num_needle_v == 1:
            for old, new in _SINGULAR:
                template, prefix = template.replace(old, new), prefix.replace(old, new)
            type_v = type_v[:-1]
        task_text = template.format(type_needle_v=type_v, context=context, query=query)
        if self.chat_template:
            task_text = chat_prompt(self.tokenizer, task_text)
        rank = {k: r for r, k in enumerate(asked)}
        order = sorted(range(len(needles)), key=lambda j: rank.get(needles[j][0], len(asked)))
        return _Drawn(text=task_text + prefix.format(type_needle_v=type_v, query=query),
                      answers=[a for i in asked for a in values[i]], query=query,
                      needles=[[keys[needles[j][0]], needles[j][1], depths[j]] for j in order],
                      units=units)

    def _essay_context(self, rng, units, texts):
        """The first ``units`` essay words in sentences, needles at depths from :data:`DEPTHS`."""
        words = self._words
        text = " ".join((words * (-(-units // len(words))))[:units])
        sents = split_sentences(text.strip())
        drawn = rng.sample(DEPTHS, len(texts))
        positions = [0] + sorted(int(len(sents) * (d / 100)) for d in drawn) + [len(sents)]
        pieces = []
        for j in range(1, len(positions)):
            pieces.append(" ".join(sents[positions[j - 1]:positions[j]]))
            if j - 1 < len(texts):
                pieces.append(texts[j - 1])
        return " ".join(pieces), [d / 100 for d in sorted(drawn)]

    def _line_context(self, rng, units, texts):
        """``units`` lines of noise (or of distractor needles), each needle inserted as a line."""
        spec = self.spec
        if spec.haystack == "noise":
            lines = [NOISE] * units
        else:
            lines = [NEEDLE.format(type_needle_v=spec.type_needle_v, key=self._random(rng, spec.type_needle_k),
                                   value=self._random(rng, spec.type_needle_v)) for _ in range(units)]
        indexes = sorted(rng.sample(range(units), len(texts)), reverse=True)
        for index, needle in zip(indexes, texts):
            lines.insert(index, needle)
        return "\n".join(lines), [index / units for index in indexes]

    def _counted(self, text) -> int:
        """Tokens RULER counts against the length: the prompt without special tokens + 128."""
        return len(self.tokenizer.encode(text)) + TOKENS_TO_GENERATE

    # --------------------------------------------------------------------- the stream
    def _incremental(self, length) -> int:
        if self.spec.haystack == "essay":
            return 500
        return 5 if length < 4096 else 25

    def _stream(self, length, seed):
        key = (int(length), int(seed))
        if key not in self._streams:
            self._streams[key] = _Stream(self, *key)
        return self._streams[key]

    def sample(self, length: int, i: int, *, samples: int, seed: int = 42) -> Sample:
        """Sample ``i`` (0-based) of RULER's stream at ``(length, seed)``; ``samples`` only bounds
        ``i`` (RULER's sample ``i`` does not depend on how many follow it). ``depth`` is the share
        of the haystack before the first asked needle (essay: its drawn depth / 100; lines: the
        haystack lines before it / all of them); ``key`` is RULER's query (several keys joined
        with ", and " for ``niah_multiquery``)."""
        length, i, samples = int(length), int(i), int(samples)
        if not 0 <= i < samples:
            raise ValueError(f"sample id {i} outside 0..{samples - 1}")
        d = self._stream(length, seed).draw(i)
        bos = [] if self.tokenizer.bos_id is None or self.chat_template else [self.tokenizer.bos_id]
        ids = bos + self.tokenizer.encode(d.text)
        return Sample(task=self.name, length=length, sample_id=i, seed=int(seed), prompt=d.text,
                      input_ids=ids, answer=d.answers[0], key=d.query, depth=d.needles[0][2],
                      max_new_tokens=TOKENS_TO_GENERATE, needles=d.needles, haystack_units=d.units,
                      answers=list(d.answers), counted_tokens=len(ids) - len(bos) + TOKENS_TO_GENERATE)

    def samples(self, length: int, samples: int, *, seed: int = 42, ids=None):
        """Samples ``ids`` (default all) at ``length``, as a list."""
        ids = range(samples) if ids is None else ids
        return [self.sample(length, i, samples=samples, seed=seed) for i in ids]

    def answer_tokens(self, samples) -> int:
        """New tokens enough to read the answers of ``samples`` (see :func:`qedprobe.tasks.sample.answer_tokens`)."""
        return answer_tokens(self.tokenizer, samples, self.max_new_tokens)

    def min_length(self) -> int:
        """A length at which RULER's smallest haystack fits (keys of a fixed draw; a draw that
        does not fit is redrawn, and :meth:`sample` says when none fits)."""
        d = self._draw(random.Random(0), 0, self._incremental(0))
        return self._counted(d.text)


class _Stream:
    """RULER's random stream at one ``(length, seed)``: the haystack size from its estimate and
    binary search, then samples in order; the generator state before each sample is kept."""

    def __init__(self, task: RulerTask, length: int, seed: int):
        self.task, self.length, self.seed = task, length, seed
        self.rng = random.Random(seed)
        self.incremental = task._incremental(length)
        self.units = self._search()
        self.states = []

    def _fits(self, units):
        return self.task._counted(self.task._draw(self.rng, self.seed, units).text) <= self.length

    def _search(self) -> int:
        """RULER's estimate (one draw at ``incremental`` units) and binary search."""
        inc, length = self.incremental, self.length
        per_unit = len(self.task.tokenizer.encode(self.task._draw(self.rng, self.seed, inc).text)) / inc
        low, high = inc, max(int((length / per_unit) * 3), inc * 2)
        best = None
        while low <= high:
            mid = (low + high) // 2
            if self._fits(mid):
                best, low = mid, mid + 1
            else:
                high = mid - 1
        return inc if best is None else best

    def _next(self, rng) -> _Drawn:
        """One sample: RULER redraws with ``incremental`` fewer units until it fits."""
        units, tries = self.units, 0
        while True:
            d = self.task._draw(rng, self.seed, units)
            if self.task._counted(d.text) <= self.length:
                return d
            if units > self.incremental:
                units -= self.incremental
                continue
            tries += 1
            if tries >= MAX_RETRIES:
                raise ValueError(
                    f"length {self.length} is too short for RULER task {self.task.name} with tokenizer "
                    f"{self.task.tokenizer.name!r}: its smallest haystack ({self.incremental} units) and "
                    f"{TOKENS_TO_GENERATE} generated tokens did not fit in {MAX_RETRIES} draws")

    def draw(self, i: int) -> _Drawn:
        """Sample ``i``: drawn from the stream when it is the next one, else replayed from its state."""
        while len(self.states) <= i:
            self.states.append(self.rng.getstate())
            drawn = self._next(self.rng)
            if len(self.states) == i + 1:
                return drawn
        rng = random.Random()
        rng.setstate(self.states[i])
        return self._next(rng)
