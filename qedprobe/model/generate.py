r"""Generation: one chunked prefill over the packed prompts, then one recurrent step per token.

Prompts of different lengths are packed into one row with ``cu_seqlens`` (B = 1, see
:mod:`.packing`), so the recurrence and the short convolutions restart at each prompt. The
prefill returns, per layer, the recurrent state ``[N, H, K, V]`` and the convolution caches;
each decode step (:mod:`.decode_step`: eager, or a CUDA-graph replay on CUDA without hooks)
feeds the N last tokens as a ``[N, 1]`` batch and carries those states on. Greedy by default;
sampling draws from ``softmax(logits / temperature)`` over the ``top_k`` largest logits.

The loop does not synchronise with the device per step: ids are checked once on the host
before the prefill, new tokens stay on the device and come to the host once, at the end. With
``eos_token_id``, whether every prompt has stopped is read after every eager step (hooks see
the steps they saw before) and every ``STOP_CHECK_EVERY`` graph steps (tokens after a prompt's
EOS are dropped, so the result is the same as stopping at once; only a sampling ``generator``
may advance by a few more draws).
"""
from __future__ import annotations

import math

import torch

from .decode_step import decode_step
from .packing import pack_prompts

def check_generate_options(max_new_tokens, eos_token_id, temperature, top_k, generator, vocab_size) -> None:
    """Refuse a bad option of ``generate`` with a ``ValueError`` naming it."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: `max_new_tokens` must be an int >= 0, got {max_new_tokens!r}")
    if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)
                                     or not 0 <= eos_token_id < vocab_size):
        raise ValueError(f"generate: `eos_token_id` must be None or an int in [0, {vocab_size}), "
                         f"got {eos_token_id!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 < temperature < math.inf:
        raise ValueError(f"generate: `temperature` must be a positive finite float, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"generate: `top_k` must be None or an int >= 1, got {top_k!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generate: `generator` must be None or a torch.Generator, got {type(generator).__name__}")


def next_tokens(logits: torch.Tensor, *, do_sample: bool, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """``[N, vocab]`` logits -> ``[N]`` token ids (argmax, or a sample)."""
    if not do_sample:
        return logits.argmax(-1)
    scaled = logits.float() / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def until_eos(tokens: torch.Tensor, eos_token_id: int | None) -> list[list[int]]:
    """``[N, S]`` new tokens -> per prompt, the tokens up to and including its first EOS."""
    rows = tokens.tolist()
    if eos_token_id is None:
        return rows
    return [r[:r.index(eos_token_id) + 1] if eos_token_id in r else r for r in rows]


@torch.no_grad()
def generate(model, prompts, max_new_tokens: int, *, eos_token_id: int | None = None,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None, cuda_graph: bool = True) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    ``prompts``: a LongTensor ``[B, T]``, a list of non-empty token-id lists, or a
    :class:`~qedprobe.model.packing.PackedPrompts` (packed once, reused across calls).
    Returns only the new tokens of each prompt; a prompt stops after ``eos_token_id``
    (included). Strength blocks with ``phase="prefill"`` act on the prompt pass,
    ``phase="decode"`` on the token steps; hooks fire in both (packed ``[1, sum T, ...]``
    shapes in the prefill, ``[N, 1, ...]`` in decode steps). ``cuda_graph`` (default on) replays
    the decode step from a CUDA graph where that is exact (CUDA, no hooks attached; see
    :mod:`.decode_step`): the same tokens bit for bit as the eager step (``tests/test_decode_fast.py``,
    passed on an H200); ``cuda_graph=False`` forces the eager step.
    """
    vocab = model.cfg.vocab_size
    packed = pack_prompts(prompts, vocab, model.device)
    check_generate_options(max_new_tokens, eos_token_id, temperature, top_k, generator, vocab)
    if max_new_tokens == 0:
        return [[] for _ in packed.lengths]
    logits, states = model.run_blocks(packed.ids, states=None, cu_seqlens=packed.cu_seqlens,
                                      scales=model.lam_scales("prefill"), want_state=True,
                                      logit_positions=packed.last_positions)
    last = logits[0]
    out = torch.empty(len(packed.lengths), max_new_tokens, dtype=torch.long, device=model.device)
    done = torch.zeros(len(packed.lengths), dtype=torch.bool, device=model.device)
    step = decode_step(model, states, model.lam_scales("decode"), cuda_graph=cuda_graph) \
        if max_new_tokens > 1 else None
    for i in range(max_new_tokens):
        tokens = next_tokens(last, do_sample=do_sample, temperature=temperature, top_k=top_k,
                             generator=generator)
        out[:, i] = tokens
        if i == max_new_tokens - 1:
            break
        if eos_token_id is not None:
            done |= tokens == eos_token_id
            if (i + 1) % step.stop_check_every == 0 and bool(done.all()):
                out = out[:, :i + 1]
                break
        last = step(tokens)
    return until_eos(out, eos_token_id)
