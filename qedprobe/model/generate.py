r"""Generation: one chunked prefill over the prompts, then one recurrent step per token.

The calling convention is Hugging Face's / TransformerLens': a ``[B, T]`` (or ``[T]``) tensor in
gives a tensor out with the prompt included, ``[B, T + S]`` (``[T + S]``); a list of token-id
lists gives lists. ``return_type="new_tokens"`` gives only the new tokens, one list per prompt.

Without hooks, prompts of different lengths are packed into one row with ``cu_seqlens`` (B = 1,
see :mod:`.packing`), so the recurrence and the short convolutions restart at each prompt. With
a hook attached anywhere in the model, the prefill runs the prompts of each distinct length as
one ``[B, T]`` batch instead, so hooks see per-prompt ``[B, T, ...]`` rows (the values of a
one-prompt run), never the packed layout. The prefill returns, per layer, the recurrent state
``[N, H, K, V]`` and the convolution caches; each decode step (:mod:`.decode_step`: eager, or a
CUDA-graph replay on CUDA without hooks) feeds the N last tokens as a ``[N, 1]`` batch and
carries those states on. Greedy by default; sampling draws from ``softmax(logits / temperature)``
restricted to the ``top_k`` largest logits, then to the smallest set of tokens whose
probability reaches ``top_p`` (Hugging Face's order and rule).

The loop does not synchronise with the device per step: ids are checked once on the host
before the prefill, new tokens stay on the device and come to the host once, at the end. When
stopping at EOS, whether every prompt has stopped is read after every eager step (hooks see the
steps they saw before); graph steps are checked every ``STOP_CHECK_EVERY`` steps and each check
is read at the next one, when more steps are queued, so the GPU is never left waiting on the
host. Tokens after a prompt's EOS are dropped and the output is cut to the longest kept
continuation, so the result does not depend on how often or how late that is read (only a
sampling ``generator`` may advance by a few more draws).
"""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from .decode_step import decode_step
from .hooked import hooks_attached
from .mixer import MixerState
from .packing import pack_prompts

DEFAULT_MAX_NEW_TOKENS = 16
"""``max_new_tokens`` when none is given (the CLI's default budget)."""

RETURN_TYPES = ("input", "new_tokens")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def eos_ids(eos_token_id, vocab_size: int) -> tuple[int, ...]:
    """``None``, an int or a list of ints -> the tuple of EOS ids, each checked to be in the vocabulary."""
    ids = () if eos_token_id is None else (eos_token_id,) if _is_int(eos_token_id) else eos_token_id
    if not isinstance(ids, (tuple, list)) or not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"generate: `eos_token_id` must be None, an int or a list of ints in "
                         f"[0, {vocab_size}), got {eos_token_id!r}")
    return tuple(ids)


def check_sampling(do_sample, temperature, top_k, top_p, generator) -> None:
    if not isinstance(do_sample, bool):
        raise ValueError(f"generate: `do_sample` must be a bool, got {do_sample!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 < temperature < math.inf:
        raise ValueError(f"generate: `temperature` must be a positive finite float, got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"generate: `top_k` must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"generate: `top_p` must be None or a float in (0, 1], got {top_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generate: `generator` must be None or a torch.Generator, got {type(generator).__name__}")
    unused = [n for n, v in (("temperature", temperature != 1), ("top_k", top_k is not None),
                             ("top_p", top_p is not None), ("generator", generator is not None)) if v]
    if unused and not do_sample:
        raise ValueError(f"generate: {', '.join(f'`{n}`' for n in unused)} act only when sampling; "
                         "pass do_sample=True (decoding is greedy by default)")


def check_generate_options(max_new_tokens, stop_at_eos, pad_token_id, return_type) -> None:
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"generate: `max_new_tokens` must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(stop_at_eos, bool):
        raise ValueError(f"generate: `stop_at_eos` must be a bool, got {stop_at_eos!r}")
    if pad_token_id is not None and not _is_int(pad_token_id):
        raise ValueError(f"generate: `pad_token_id` must be None or an int, got {pad_token_id!r}")
    if return_type not in RETURN_TYPES:
        raise ValueError(f"generate: `return_type` must be one of {RETURN_TYPES}, got {return_type!r}")


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """``[N, vocab]`` logits with every token outside the ``top_k`` largest, then outside the
    nucleus (the most likely tokens whose probabilities, summed in decreasing order, first reach
    ``top_p``; the most likely token always stays), set to ``-inf``."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None and top_p < 1:
        probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # probability of the tokens ranked above each one
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p)
        logits = logits.masked_fill(drop, -math.inf)
    return logits


def next_tokens(logits: torch.Tensor, *, do_sample: bool, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """``[N, vocab]`` logits -> ``[N]`` token ids (argmax, or a sample)."""
    if not do_sample:
        return logits.argmax(-1)
    probs = torch.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _cat_states(parts: list[list[MixerState]], rows: torch.Tensor) -> list[MixerState]:
    """Per layer, the groups' states concatenated along N and put in prompt order (``rows``:
    for each prompt, its row in the concatenation)."""
    def cat(ts):
        return torch.cat(ts)[rows]
    return [MixerState(cat([p[l].recurrent for p in parts]),
                       tuple(cat([p[l].conv[i] for p in parts]) for i in range(len(parts[0][l].conv))))
            for l in range(len(parts[0]))]


def prefill(model, packed, lambda_scale=None) -> tuple[torch.Tensor, list[MixerState]]:
    """The prompt pass: ``(logits [N, vocab] at each prompt's last token, per-layer states)``,
    with the prefill factors of ``lambda_scale`` (None: the ``strength`` blocks').

    Without hooks, one pass over the packed row; with hooks, one ``[B, T]`` pass per distinct
    prompt length (so a hook sees each prompt as its own row).
    """
    scales = model.lam_scales("prefill", lambda_scale)
    if not hooks_attached(model):
        logits, states = model.run_blocks(packed.ids, states=None, cu_seqlens=packed.cu_seqlens,
                                          scales=scales, want_state=True,
                                          logit_positions=packed.last_positions)
        return logits[0], states
    order, logits, parts = [], [], []
    for prompts, ids in packed.by_length():
        last = torch.tensor([ids.shape[1] - 1], device=ids.device)
        out, states = model.run_blocks(ids, states=None, cu_seqlens=None, scales=scales,
                                       want_state=True, logit_positions=last)
        order += prompts
        logits.append(out[:, 0])
        parts.append(states)
    rows = torch.empty(len(order), dtype=torch.long)
    rows[torch.tensor(order)] = torch.arange(len(order))
    rows = rows.to(packed.ids.device)
    return torch.cat(logits)[rows], _cat_states(parts, rows)


def _decode(model, packed, max_new_tokens, stop_ids, sampling, cuda_graph, lambda_scale,
            verbose=False) -> torch.Tensor:
    """``[N, S]`` new token ids (``S <= max_new_tokens``; fewer once every prompt emitted one of
    ``stop_ids``); ``verbose`` shows a progress bar over the new tokens."""
    with tqdm(total=max_new_tokens, unit="token", desc="generate", disable=not verbose) as bar:
        return _decode_steps(model, packed, max_new_tokens, stop_ids, sampling, cuda_graph, lambda_scale,
                             bar.update)


def _decode_steps(model, packed, max_new_tokens, stop_ids, sampling, cuda_graph, lambda_scale, tick) -> torch.Tensor:
    """:func:`_decode`'s loop; ``tick()`` after each new token."""
    last, states = prefill(model, packed, lambda_scale)
    out = torch.empty(len(packed.lengths), max_new_tokens, dtype=torch.long, device=model.device)
    done = torch.zeros(len(packed.lengths), dtype=torch.bool, device=model.device)
    stop = torch.tensor(stop_ids, dtype=torch.long, device=model.device)
    step = decode_step(model, states, model.lam_scales("decode", lambda_scale), cuda_graph=cuda_graph) \
        if max_new_tokens > 1 else None
    unread = None
    for i in range(max_new_tokens):
        tokens = next_tokens(last, **sampling)
        out[:, i] = tokens
        tick()
        if i == max_new_tokens - 1:
            break
        if stop_ids:
            done |= torch.isin(tokens, stop)
            if (i + 1) % step.stop_check_every == 0:
                if step.stop_read_late:
                    unread, check = _StopCheck(done), unread
                else:
                    check = _StopCheck(done)
                if check is not None and check.all_stopped():
                    return out[:, :i + 1]
        last = step(tokens)
    return out


class _StopCheck:
    """Whether every prompt had stopped (``done.all()``) when it was taken, readable later without
    waiting for what the device queued since: on CUDA the flag goes to pinned host memory behind
    an event, and reading it waits for that event only."""

    def __init__(self, done: torch.Tensor):
        self.event = None
        if done.is_cuda:
            self.flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            self.flag.copy_(done.all(), non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.flag = done.all()

    def all_stopped(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.flag)


def until_stop(rows: list[list[int]], stop_ids: tuple[int, ...]) -> list[list[int]]:
    """Per prompt, the new tokens up to and including its first token in ``stop_ids``."""
    def cut(r):
        at = next((i for i, t in enumerate(r) if t in stop_ids), None)
        return r if at is None else r[:at + 1]
    return [cut(r) for r in rows] if stop_ids else rows


def as_output(prompts, packed, new: list[list[int]], return_type: str, pad_token_id, eos: tuple[int, ...]):
    """``generate``'s result from the new tokens per prompt: ``new`` itself for
    ``return_type="new_tokens"``, else the prompts followed by their new tokens in the input's
    form: a tensor for a tensor input (rows padded with ``pad_token_id``, default the first EOS id,
    after their EOS), one list per prompt otherwise."""
    if return_type == "new_tokens":
        return new
    if not isinstance(prompts, torch.Tensor):
        flat, starts = packed.ids[0].tolist(), packed.cu_seqlens.tolist()
        return [flat[a:b] + n for a, b, n in zip(starts, starts[1:], new)]
    pad = pad_token_id if pad_token_id is not None else eos[0] if eos else 0
    tail = torch.full((len(new), max(map(len, new))), pad, dtype=torch.long)
    for i, n in enumerate(new):
        tail[i, :len(n)] = torch.tensor(n, dtype=torch.long)
    full = torch.cat([packed.ids.view(len(new), -1), tail.to(packed.ids.device)], dim=1)
    return full[0] if prompts.dim() == 1 else full


@torch.no_grad()
def checked_generate_inputs(model, prompts, max_new_tokens, *, eos_token_id, stop_at_eos, do_sample,
                            temperature, top_k, top_p, generator, return_type, pad_token_id):
    """What every ``generate`` (ours and the transformers adapter's) does before decoding: pack
    the prompts and refuse bad options by name. Returns ``(packed, eos, stop_ids)``: the EOS ids
    (which also pad the output) and the ids that end a prompt (none with ``stop_at_eos=False``)."""
    vocab = model.cfg.vocab_size
    packed = pack_prompts(prompts, vocab, model.device)
    check_generate_options(max_new_tokens, stop_at_eos, pad_token_id, return_type)
    check_sampling(do_sample, temperature, top_k, top_p, generator)
    eos = eos_ids(eos_token_id, vocab)
    return packed, eos, (eos if stop_at_eos else ())


def generate(model, prompts, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
             eos_token_id: int | list[int] | None = None, stop_at_eos: bool = True,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, generator: torch.Generator | None = None,
             return_type: str = "input", pad_token_id: int | None = None,
             cuda_graph: bool = True, verbose: bool = False, use_past_kv_cache: bool = True,
             prepend_bos: bool | None = None, lambda_scale=None):
    """Continue each prompt by up to ``max_new_tokens`` tokens (greedy unless ``do_sample``).

    ``prompts``: an integer tensor ``[B, T]`` or ``[T]``, a list of non-empty token-id lists, a
    :class:`~qedprobe.model.packing.PackedPrompts` (packed once, reused across calls), or a text
    / list of texts (through the model's tokenizer, ``model.to_tokens`` with ``prepend_bos``).
    ``eos_token_id``: an id or a list of ids; with ``stop_at_eos`` (default) a prompt stops
    after its first one (included); ``stop_at_eos=False`` always decodes ``max_new_tokens``.

    Returns, with ``return_type="input"`` (default), the prompts followed by their new tokens in
    the input's form: a ``[B, T + S]`` (``[T + S]``) LongTensor on the model's device for a tensor
    input, where ``S`` is the longest continuation and a row that stopped earlier is filled with
    ``pad_token_id`` (default: the first EOS id); one list per prompt for lists; the text with
    its continuation for texts (special tokens dropped). With ``return_type="new_tokens"``: one
    list of new tokens per prompt (ragged, each up to its EOS).

    Strength blocks with ``phase="prefill"`` act on the prompt pass, ``phase="decode"`` on the
    token steps; ``lambda_scale`` (a :class:`~qedprobe.model.strength.LambdaScale`) is this call's
    strength instead of the blocks' around it. Hooks fire in both: in the prefill once per distinct prompt length with
    ``[B, T, ...]`` rows of the prompts of that length, in each decode step with ``[N, 1, ...]``
    (all prompts, in order). ``cuda_graph`` (default on) replays the decode step from a CUDA
    graph where that is exact (CUDA, no hooks attached; see :mod:`.decode_step`): the same
    tokens bit for bit as the eager step (``tests/test_decode_fast.py`` checks it on CUDA);
    ``cuda_graph=False`` forces the eager step. ``verbose`` shows a progress bar over the new
    tokens. ``use_past_kv_cache`` must stay True: every step continues the carried recurrent
    state (a recurrence has no key-value cache to leave out; recomputing the prefix gives the
    same tokens more slowly).
    """
    if use_past_kv_cache is not True:
        raise ValueError(f"generate: `use_past_kv_cache` must be True, got {use_past_kv_cache!r}: each step "
                         "continues the carried recurrent state (re-running the prefix would give the same tokens)")
    texts = _text_prompts(prompts)
    if texts is not None:
        one = [texts] if isinstance(texts, str) else texts
        prompts = [model.to_tokens(t, prepend_bos=prepend_bos)[0].tolist() for t in one]
    packed, eos, stop_ids = checked_generate_inputs(
        model, prompts, max_new_tokens, eos_token_id=eos_token_id, stop_at_eos=stop_at_eos,
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
        return_type=return_type, pad_token_id=pad_token_id)
    new = [[] for _ in packed.lengths]
    if max_new_tokens > 0:
        sampling = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                        generator=generator)
        new = until_stop(_decode(model, packed, max_new_tokens, stop_ids, sampling, cuda_graph, lambda_scale,
                                 verbose).tolist(), stop_ids)
    out = as_output(prompts, packed, new, return_type, pad_token_id, eos)
    if texts is None or return_type != "input":
        return out
    return model.to_string(out[0]) if isinstance(texts, str) else [model.to_string(r) for r in out]


def _text_prompts(prompts):
    """``prompts`` itself when it is a text or a non-empty list of texts, else None."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and all(isinstance(p, str) for p in prompts)):
        return prompts
    return None
