r"""The ``qedprobe`` model of lm-evaluation-harness: a QED checkpoint, or a transformers Gated
DeltaNet model run through :mod:`qedprobe.hf`, evaluated with lambda rescaled by a strength.

    import qedprobe.lmeval, lm_eval                  # importing registers the model "qedprobe"
    lm_eval.simple_evaluate(model="qedprobe", model_args="pretrained=checkpoints/micro-full,strength=0.5",
                            tasks=["fda"])

Every model call runs inside ``qedprobe.model.strength(model, strength, layers=, heads=,
phase=)`` (no block when ``strength`` is none: the model as it is), so ``lambda -> s * lambda``
holds for the whole evaluation; on CUDA a ``QEDModel`` runs its compiled fast path
(``qedprobe.model.fast_path``) with CUDA-graph decode steps unless ``eager=true``.

* ``loglikelihood``: ``sum_i log p(cont_i | ctx, cont_<i)`` from one forward pass per batch
  (a prefill: a ``phase=decode`` strength leaves it unchanged). Rows of a batch are padded on the
  right: the recurrence and the convolutions are causal, so padding never reaches a scored
  position; logits are computed only from the first scored position of the batch on.
* ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens
  (without a ``max_length``: the whole text in one window, the recurrence has no context limit).
* ``generate_until``: qedprobe's own ``generate`` (one packed prefill, then one token per step
  with the carried recurrent and convolution state), greedy unless ``do_sample`` with a positive
  ``temperature``; a prompt stops at EOS or at a stop sequence that is one token, and the text is
  cut before the first stop sequence of ``until``. ``max_gen_toks`` defaults to 256 (as lm-eval's
  ``hf`` model).

Prompts are the tokenizer's ids with the BOS token in front when the tokenizer has one (as
``qedprobe sweep`` gives them); a prompt longer than ``max_length`` (with ``max_gen_toks`` for a
generation) is refused, never truncated.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import lm_eval.models  # noqa: F401  lm-eval's own models first: its registry loads them only while empty
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from qedprobe.lam import check_strengths
from qedprobe.model import QEDModel, fast_path, strength

from .load import ModelArgsError, load_model, parse_model_args

__all__ = ["QEDProbeLM", "GenerationOptions", "RequestError", "DEFAULT_MAX_GEN_TOKS"]

DEFAULT_MAX_GEN_TOKS = 256
"""Tokens generated when a request names no ``max_gen_toks`` (lm-eval's ``hf`` model default)."""

GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


class RequestError(ValueError):
    """A request the model cannot serve as asked (an unsupported generation argument, a prompt
    longer than ``max_length``); the message names the argument."""


@dataclass(frozen=True)
class GenerationOptions:
    """One request's generation arguments, checked; requests with equal options share batches."""

    until: tuple[str, ...]
    max_gen_toks: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "GenerationOptions":
        """lm-eval's ``gen_kwargs`` (``until``: a string or a list of strings; sampling only with
        ``do_sample`` and a temperature > 0, lm-eval's convention); other keys are refused."""
        unknown = sorted(set(kwargs) - set(GENERATION_KEYS))
        if unknown:
            raise RequestError(f"qedprobe generate_until: generation argument(s) {', '.join(unknown)} not supported "
                             f"(supported: {', '.join(GENERATION_KEYS)})")
        until = kwargs.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(until)
        if not all(isinstance(u, str) and u for u in until):
            raise RequestError(f"qedprobe generate_until: `until` must be a non-empty string or a list of them, got {until!r}")
        n = kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RequestError(f"qedprobe generate_until: `max_gen_toks` must be an integer >= 1, got {n!r}")
        temperature = kwargs.get("temperature")
        sample = bool(kwargs.get("do_sample", False)) and temperature != 0
        return cls(until=until, max_gen_toks=n, do_sample=sample,
                   temperature=1.0 if temperature is None or not sample else float(temperature),
                   top_k=kwargs.get("top_k") if sample else None, top_p=kwargs.get("top_p") if sample else None)


def cut_at_stops(text: str, until: tuple[str, ...]) -> str:
    """``text`` up to the first occurrence of any stop sequence of ``until``."""
    for stop in until:
        text = text.split(stop, 1)[0]
    return text


def batches_by_length(indices, lengths, batch_size: int):
    """``indices`` sorted by decreasing ``lengths[i]`` (rows of a batch have similar lengths),
    in chunks of ``batch_size``."""
    order = sorted(indices, key=lambda i: -lengths[i])
    return [order[k:k + batch_size] for k in range(0, len(order), batch_size)]


@register_model("qedprobe")
class QEDProbeLM(TemplateLM):
    """lm-eval's ``LM`` on a qedprobe model; ``model_args`` as :func:`qedprobe.lmeval.load.parse_model_args`
    (``pretrained``, ``tokenizer``, ``strength``, ``phase``, ``layers``, ``heads``, ``qed_lambda``,
    ``qed_arm``, ``dtype``, ``device``, ``batch_size``, ``max_length``, ``allow_extrapolation``,
    ``eager``)."""

    def __init__(self, pretrained=None, **kwargs):
        super().__init__()
        self.args = parse_model_args(**({} if pretrained is None else {"pretrained": pretrained}), **kwargs)
        self.model, self.tokenizer = load_model(self.args)
        self._device = self.model.device
        self.strength = None
        self.set_strength(self.args.strength)
        self.fast = not self.args.eager and self._device.type == "cuda" and isinstance(self.model, QEDModel)

    # ------------------------------------------------------------------ the intervention
    def set_strength(self, s: float | None) -> None:
        """Rescale lambda by ``s`` from now on (None: no strength block at all). Checked against
        the model's arm and the tested range (``allow_extrapolation``), with ``layers``, ``heads``
        and ``phase``."""
        a = self.args
        try:
            if s is not None:
                check_strengths([s], arm=self.model.cfg.arm, allow_extrapolation=a.allow_extrapolation)
            with strength(self.model, 1.0 if s is None else s, layers=_maybe_list(a.layers),
                          heads=_maybe_list(a.heads), phase=a.phase, allow_extrapolation=a.allow_extrapolation):
                pass
        except ValueError as exc:
            raise ModelArgsError(f"qedprobe model_args: `strength` {s!r}: {exc}") from None
        self.strength = None if s is None else float(s)

    @contextlib.contextmanager
    def running(self):
        """The context of every model call: inference mode, the strength block, the fast path."""
        a = self.args
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode())
            if self.strength is not None:
                stack.enter_context(strength(self.model, self.strength, layers=_maybe_list(a.layers),
                                             heads=_maybe_list(a.heads), phase=a.phase,
                                             allow_extrapolation=a.allow_extrapolation))
            if self.fast:
                stack.enter_context(fast_path(self.model))
            yield

    # ------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        tok = self.tokenizer
        return tok.eos_id if tok.eos_id is not None else tok.bos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context conditions on: BOS when the tokenizer has one, else EOS."""
        tok = self.tokenizer
        return tok.bos_id if tok.bos_id is not None else tok.eos_id

    @property
    def max_length(self) -> int | None:
        """``max_length``; else a transformers model's ``max_position_embeddings``; else None (no limit)."""
        if self.args.max_length is not None:
            return self.args.max_length
        hf = getattr(self.model, "hf_model", None)
        return getattr(getattr(hf, "config", None), "max_position_embeddings", None)

    @property
    def batch_size(self) -> int:
        return self.args.batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The tokenizer's ids of ``string``, BOS first when the tokenizer has one (unless
        ``add_special_tokens`` is False)."""
        ids = self.tokenizer.encode(string)
        bos = self.tokenizer.bos_id
        return ids if add_special_tokens is False or bos is None else [bos, *ids]

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    def _check_fits(self, n_tokens: int, what: str) -> None:
        if self.max_length is not None and n_tokens > self.max_length:
            raise RequestError(f"qedprobe: a {what} of {n_tokens} tokens exceeds max_length={self.max_length} "
                             "(raise `max_length`; nothing is truncated)")

    # ------------------------------------------------------------------ loglikelihood
    def window_logits(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Logits ``[B, T - start, V]`` of positions ``start .. T - 1`` of ``ids`` ``[B, T]`` (one
        prefill pass; only those positions reach the LM head)."""
        if isinstance(self.model, QEDModel):
            positions = torch.arange(start, ids.shape[1], device=ids.device)
            return self.model.forward_with_state(ids, logit_positions=positions)[0]
        return self.model.hf_model(input_ids=ids, use_cache=False, logits_to_keep=ids.shape[1] - start).logits

    def score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum log p(cont | ctx), cont is the greedy continuation)`` per ``(ctx, cont)`` pair, one
        right-padded forward pass; log-softmax in float32 (float64 for a float64 model)."""
        inputs = [(ctx + cont)[:-1] for ctx, cont in pairs]
        T = max(len(x) for x in inputs)
        first = [len(x) - len(cont) for x, (_, cont) in zip(inputs, pairs)]
        start = min(min(first), T - 1)
        pad = self.eot_token_id
        ids = torch.tensor([x + [pad] * (T - len(x)) for x in inputs], device=self._device)
        with self.running():
            logits = self.window_logits(ids, start)
        logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
        out = []
        for b, (_, cont) in enumerate(pairs):
            rows = logp[b, first[b] - start:first[b] - start + len(cont)]
            target = torch.tensor(cont, device=rows.device, dtype=torch.long)
            total = float(rows.gather(-1, target[:, None]).sum())
            out.append((total, bool((rows.argmax(-1) == target).all())))
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``requests``: ``((context, continuation) or None, context ids, continuation ids)``."""
        for _, ctx, cont in requests:
            self._check_fits(len(ctx) + len(cont) - 1, "context with its continuation")
        lengths = [len(ctx) + len(cont) for _, ctx, cont in requests]
        results = [None] * len(requests)
        for batch in batches_by_length(range(len(requests)), lengths, self.batch_size):
            scores = self.score_batch([(requests[i][1], requests[i][2]) for i in batch])
            for i, score in zip(batch, scores):
                results[i] = score
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over lm-eval's disjoint rolling windows (first window
        conditioned on :attr:`prefix_token_id`)."""
        windows, owner = [], []
        for i, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0], add_special_tokens=False)
            span = self.max_length or max(len(tokens), 1)
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=span, context_len=1)):
                windows.append((None, list(ctx), list(cont)))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def stop_token_ids(self, until: tuple[str, ...]) -> list[int]:
        """EOS and every stop sequence that is a single token: generation of a row ends there
        (longer stop sequences are cut from the text afterwards)."""
        ids = [self.tokenizer.eos_id] if self.tokenizer.eos_id is not None else []
        for stop in until:
            enc = self.tokenizer.encode(stop)
            if len(enc) == 1 and enc[0] not in ids:
                ids.append(enc[0])
        return ids

    def generate_batch(self, prompts: list[list[int]], options: GenerationOptions) -> list[str]:
        """One ``generate`` call on ``prompts`` (token-id lists): the new text of each, cut at ``until``."""
        sampling = dict(do_sample=True, temperature=options.temperature, top_k=options.top_k,
                        top_p=options.top_p) if options.do_sample else {}
        with self.running():
            new = self.model.generate(prompts, options.max_gen_toks, eos_token_id=self.stop_token_ids(options.until),
                                      return_type="new_tokens", cuda_graph=not self.args.eager, **sampling)
        return [cut_at_stops(self.tokenizer.decode(toks), options.until) for toks in new]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with equal generation options are batched together, longest prompts first."""
        options = [GenerationOptions.from_kwargs(dict(req.args[1])) for req in requests]
        prompts = [self.tok_encode(req.args[0]) for req in requests]
        for p, o in zip(prompts, options):
            self._check_fits(len(p) + o.max_gen_toks, "prompt with its max_gen_toks")
        results = [None] * len(requests)
        for opt in dict.fromkeys(options):
            same = [i for i, o in enumerate(options) if o == opt]
            for batch in batches_by_length(same, [len(p) for p in prompts], self.batch_size):
                for i, text in zip(batch, self.generate_batch([prompts[i] for i in batch], opt)):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    def get_model_info(self) -> dict:
        """What lm-eval records of the model in its results' ``config``."""
        a = self.args
        return {"qedprobe_model": a.pretrained, "arm": self.model.cfg.arm, "strength": self.strength,
                "phase": a.phase, "tokenizer": self.tokenizer.name}


def _maybe_list(indices):
    return None if indices is None else list(indices)
