"""What a strength sweep is: :class:`SweepSpec`, frozen and validated once, and the checks and
folder record that follow from it.

    from qedprobe.eval import SweepSpec, run_sweep
    spec = SweepSpec(task="niah_single_1", lengths=[1024, 2048], strengths=[-1, 0, 0.5, 1, 1.5, 2],
                     samples=500, seed=0)
    result = run_sweep(model, spec, out="runs/a")

Everything a sweep needs but the model and the output folder is in the spec: the samples
(``task``, its options, ``lengths``, ``samples``, ``seed``), the intervention (``strengths``,
``layers``, ``heads``, ``phase``), the statistics (``ref_strength``) and how the rows are
computed (``decode``, ``batch_size``, ``batch_tokens``, ``cuda_graph``, ``fast_path``,
``time_limit``, ``progress``). Every check that needs no model runs when the spec is built (a
:class:`qedprobe.eval.store.SweepError` naming the argument); :func:`check_model` holds the spec
against a model's config once one is at hand; :func:`sweep_config` is what a sweep folder records.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from qedprobe.lam import check_strengths
from qedprobe.tasks import ANSWER_MARGIN, DEFAULT_FORMAT, make_task

from .arguments import SweepError, parse_float_list, parse_int_list
from .store import strength_key

__all__ = ["SweepSpec", "DECODE_RULES", "PHASES", "sweep_config", "model_fingerprint", "check_model",
           "check_eval_seed", "check_strengths_for", "check_tokenizer_fits", "validate_grid", "parse_int_list",
           "parse_float_list"]

DECODE_RULES = ("budget", "answer")
"""How many tokens a sweep decodes per prompt: the task's budget, or what the answers need."""

PHASES = ("all", "prefill", "decode")
"""Where a strength scales lambda (``qedprobe.model.strength``'s ``phase``)."""


@dataclass(frozen=True, kw_only=True)
class SweepSpec:
    """One strength sweep: every ``(length, s, sample_id)`` of the grid, once.

    ``task``: a task name, built in ``task_format`` (``"ruler"``, the default, or ``"legacy"``, the
    shipped checkpoints' format) with ``tokenizer`` (``"bytes"``, a local HF folder or a tokenizer
    object) and the legacy options ``haystack_file``, ``num_needles``, ``max_new_tokens``,
    ``haystack`` (:func:`qedprobe.tasks.make_task`); or a task object (those options unused).
    After construction ``task`` is always the task object.
    ``lengths`` (tokens) and ``strengths`` (s in ``lambda -> s * lambda``): distinct; ``samples``
    prompts per length and strength, drawn with ``seed``.
    ``layers``, ``heads``, ``phase``, ``allow_extrapolation``: which lambdas the strength scales
    (``qedprobe.model.strength``). ``ref_strength``: the McNemar reference (default 1).
    ``decode``: ``"budget"`` decodes the task's ``max_new_tokens`` per prompt (the tokens the prompt
    length reserves); ``"answer"`` decodes only what the longest answer of each batch needs
    (``task.answer_tokens``: 11 instead of 16 for 7-digit numbers in bytes), so a prediction is a
    prefix of the ``"budget"`` one; recorded in ``config.json`` as ``decode``.
    ``batch_size``: prompts per generate call (default: ``batch_tokens // length`` on CUDA, 4 on
    CPU); ``batch_tokens`` defaults to :func:`qedprobe.eval.plan.memory_batch_tokens`.
    ``cuda_graph``: replay the decode step from a CUDA graph where that is exact (CUDA, no hooks;
    ``QEDModel.generate``); False forces eager steps. Rows are the same either way.
    ``fast_path``: run the model's compiled fast path (:func:`qedprobe.eval.sweep.sweep_fast_path`:
    by default on CUDA for a ``QEDModel``; False forces the plain path, a string names the
    ``torch.compile`` backend). ``time_limit``: seconds after which no new batch starts.
    ``model_id``: the id the folder records (default: the model folder's path, when ``run_sweep``
    is given a folder). ``progress``: a progress bar.
    """

    task: object = "s-niah-1"
    lengths: tuple
    strengths: tuple
    samples: int
    seed: int = 0
    tokenizer: object = "bytes"
    task_format: str = DEFAULT_FORMAT
    haystack_file: object = None
    num_needles: int | None = None
    max_new_tokens: int | None = None
    haystack: str | None = None
    layers: tuple | None = None
    heads: tuple | None = None
    phase: str = "all"
    allow_extrapolation: bool = False
    ref_strength: float = 1.0
    decode: str = "budget"
    batch_size: int | None = None
    batch_tokens: int | None = None
    cuda_graph: bool = True
    fast_path: object = None
    time_limit: float | None = None
    model_id: str | None = None
    progress: bool = True

    def __post_init__(self):
        set_ = self._set
        set_("lengths", tuple(int(x) for x in self.lengths))
        set_("strengths", tuple(float(s) for s in self.strengths))
        set_("ref_strength", float(self.ref_strength))
        for name in ("layers", "heads"):
            if getattr(self, name) is not None:
                set_(name, tuple(int(i) for i in getattr(self, name)))
        if not hasattr(self.task, "sample"):
            set_("task", make_task(self.task, self.tokenizer, format=self.task_format,
                                   haystack_file=self.haystack_file, num_needles=self.num_needles,
                                   max_new_tokens=self.max_new_tokens, haystack=self.haystack))
        check_eval_seed(self.seed)
        validate_grid(self.task, list(self.lengths), list(self.strengths), self.samples, self.phase,
                      self.allow_extrapolation)
        _check_run_options(self)

    def _set(self, name: str, value) -> None:
        """Normalise field ``name`` while the frozen spec is being built."""
        object.__setattr__(self, name, value)

    def replace(self, **changes) -> SweepSpec:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


def _check_run_options(spec: SweepSpec) -> None:
    """The options of how rows are computed: decode rule, batch sizes, time limit."""
    if spec.decode not in DECODE_RULES:
        raise SweepError(f"decode must be one of {DECODE_RULES}, got {spec.decode!r}")
    for name in ("batch_size", "batch_tokens"):
        value = getattr(spec, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SweepError(f"`{name}` must be >= 1, got {value!r}")
    if spec.time_limit is not None and not spec.time_limit >= 0:
        raise SweepError(f"`time_limit` must be >= 0 seconds, got {spec.time_limit!r}")


FINGERPRINT_EXCLUDES = ("op_mode", "decay_a_range", "decay_dt_range", "task_format")
"""Config keys that do not change what a built model computes (the op used; the initialisation
ranges; the recorded training format): left out of a sweep's model fingerprint, so folders stay
resumable across them."""


def model_fingerprint(cfg) -> dict:
    """The model config a sweep folder records (a ``QEDConfig`` or None), less
    :data:`FINGERPRINT_EXCLUDES`; the loaded model's and its ``config.json``'s are the same."""
    if cfg is None:
        return {}
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    for key in FINGERPRINT_EXCLUDES:
        d.pop(key, None)
    return d


def sweep_config(spec: SweepSpec, *, model_id, model_cfg, dtype, weights) -> dict:
    """What defines a sweep folder (``config.json``): the samples, the intervention, the model
    (id, :func:`model_fingerprint`, weights dtype name, ``weights``: the loaded state dict's
    SHA-256, ``qedprobe.model.checkpoint.state_dict_sha256``, so that rows of different weights
    behind one config never mix), the grid, the reference strength and, unless
    ``decode="budget"``, the decode rule."""
    config = {
        "samples_spec": {**spec.task.describe(), "samples": int(spec.samples), "seed": int(spec.seed)},
        "intervention": {"layers": None if spec.layers is None else list(spec.layers),
                         "heads": None if spec.heads is None else list(spec.heads), "phase": spec.phase},
        "model": {"id": model_id, "config": model_fingerprint(model_cfg), "dtype": dtype, "weights": weights},
        "lengths": list(spec.lengths), "strengths": list(spec.strengths),
        "ref_strength": spec.ref_strength,
    }
    if spec.decode != "budget":
        config["decode"] = {"rule": spec.decode, "margin": ANSWER_MARGIN}
    return config


def check_strengths_for(strengths, *, arm, allow_extrapolation=True):
    """``qedprobe.lam.check_strengths`` (the rule ``strength`` applies), as a SweepError, before any
    work (a gdn2 model has lambda = 0: only s = 1 applies)."""
    try:
        check_strengths(strengths, arm=arm, allow_extrapolation=allow_extrapolation)
    except ValueError as exc:
        raise SweepError(str(exc)) from None


def check_eval_seed(seed) -> None:
    """An evaluation seed is an int >= 0: the negative ones are the training stream (training
    seed ``s`` draws its documents with seed ``-(1 + s)``, ``qedprobe.train.data.niah_seed``), so
    a negative one would evaluate on training prompts."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SweepError(f"`seed` must be an int >= 0, got {seed!r}: negative seeds draw the training "
                         "prompts (training seed s reads seed -(1 + s))")


def validate_grid(nt, lengths, strengths, samples, phase, allow_extrapolation) -> None:
    """The checks that need no model: sample count, lengths (distinct, long enough for ``nt``),
    strengths (distinct, finite, in range), phase."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise SweepError(f"`samples` must be a positive integer, got {samples!r}")
    if not lengths or any(L < 1 for L in lengths) or len(set(lengths)) != len(lengths):
        raise SweepError(f"`lengths` must be distinct positive integers, got {lengths}")
    if not strengths or len({strength_key(s) for s in strengths}) != len(strengths):
        raise SweepError(f"`strengths` must be distinct numbers, got {strengths}")
    if any(not math.isfinite(s) for s in strengths):
        raise SweepError("`strengths` must be finite")
    check_strengths_for(strengths, arm=None, allow_extrapolation=allow_extrapolation)
    if phase not in PHASES:
        raise SweepError(f"phase must be all, prefill or decode, got {phase!r}")
    need = nt.min_length()
    short = [L for L in lengths if L < need]
    if short:
        raise SweepError(f"lengths {short} are too short for {nt.name} with this tokenizer "
                         f"(need >= {need} tokens)")


def check_tokenizer_fits(tokenizer, vocab_size: int) -> None:
    """The tokenizer's ids must lie in the model's vocabulary ``range(vocab_size)``."""
    if tokenizer.vocab_size > vocab_size:
        raise SweepError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} ids but the "
                         f"model's vocabulary has {vocab_size}: wrong --tokenizer for this model?")


def check_model(spec: SweepSpec, cfg) -> None:
    """The checks of ``spec`` against a model config (loaded or read from ``config.json``): the arm
    allows the strengths, the tokenizer's ids fit the vocabulary, ``layers`` / ``heads`` exist."""
    if cfg is None:
        return
    check_strengths_for(spec.strengths, arm=getattr(cfg, "arm", None))
    vs = getattr(cfg, "vocab_size", None)
    if vs is not None:
        check_tokenizer_fits(spec.task.tokenizer, vs)
    layers = None if spec.layers is None else list(spec.layers)
    heads = None if spec.heads is None else list(spec.heads)
    for name, sel, size in (("--layers", layers, getattr(cfg, "num_hidden_layers", None)),
                            ("--heads", heads, getattr(cfg, "num_heads", None))):
        if sel is not None and size is not None and any(not 0 <= i < size for i in sel):
            raise SweepError(f"{name} {sel} outside 0..{size - 1}")
    linear = getattr(cfg, "linear_layers", None)  # a transformers model (qedprobe.hf): lambda lives there only
    if layers is not None and linear is not None and any(i not in linear for i in layers):
        raise SweepError(f"--layers {layers}: the recurrence runs in the linear-attention layers {list(linear)} only")
