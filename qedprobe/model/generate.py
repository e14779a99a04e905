r"""Generation: one chunked prefill over the packed prompts, then one recurrent step per token.

Prompts of different lengths are packed into one row with ``cu_seqlens`` (B = 1), so the
recurrence and the short convolutions restart at each prompt. The prefill returns, per layer,
the recurrent state ``[N, H, K, V]`` and the convolution caches; each decode step feeds the N
last tokens as a ``[N, 1]`` batch and carries those states on. Greedy by default; sampling
draws from ``softmax(logits / temperature)`` over the ``top_k`` largest logits.
"""
from __future__ import annotations

import math

import torch


def _prompt_lists(prompts, vocab_size: int) -> list[list[int]]:
    """Validate ``prompts`` (a LongTensor ``[B, T]`` or a list of non-empty token-id lists)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.dtype not in (torch.int32, torch.int64) or prompts.numel() == 0:
            raise ValueError(f"generate: tensor `prompts` must be a non-empty integer tensor [B, T], "
                             f"got {prompts.dtype} {tuple(prompts.shape)}")
        seqs = prompts.tolist()
    elif isinstance(prompts, (list, tuple)) and prompts:
        seqs = [list(p) if isinstance(p, (list, tuple)) else None for p in prompts]
        if any(not s for s in seqs):
            raise ValueError("generate: `prompts` must be a list of non-empty lists of token ids")
    else:
        raise ValueError(f"generate: `prompts` must be a LongTensor [B, T] or a non-empty list of "
                         f"token-id lists, got {prompts!r:.80}")
    bad = [t for s in seqs for t in s
           if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"generate: token ids must be ints in [0, {vocab_size}), got {bad[:5]}")
    return seqs


def _check_options(max_new_tokens, eos_token_id, temperature, top_k, generator, vocab_size) -> None:
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


@torch.no_grad()
def generate(model, prompts, max_new_tokens: int, *, eos_token_id: int | None = None,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    Returns only the new tokens of each prompt; a prompt stops after ``eos_token_id``
    (included). Strength blocks with ``phase="prefill"`` act on the prompt pass,
    ``phase="decode"`` on the token steps; hooks fire in both (packed ``[1, sum T, ...]``
    shapes in the prefill, ``[N, 1, ...]`` in decode steps).
    """
    vocab = model.cfg.vocab_size
    seqs = _prompt_lists(prompts, vocab)
    _check_options(max_new_tokens, eos_token_id, temperature, top_k, generator, vocab)
    new = [[] for _ in seqs]
    if max_new_tokens == 0:
        return new
    device = model.device
    ids = torch.tensor([[t for s in seqs for t in s]], dtype=torch.long, device=device)
    ends = torch.tensor([len(s) for s in seqs], device=device).cumsum(0)
    cu_seqlens = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
    logits, states = model.forward_with_state(ids, cu_seqlens=cu_seqlens, phase="prefill", want_state=True,
                                              logit_positions=ends - 1)
    last = logits[0]
    done = [False] * len(seqs)
    for step in range(max_new_tokens):
        tokens = next_tokens(last, do_sample=do_sample, temperature=temperature, top_k=top_k,
                             generator=generator)
        for i, t in enumerate(tokens.tolist()):
            if not done[i]:
                new[i].append(t)
                done[i] = t == eos_token_id
        if all(done) or step == max_new_tokens - 1:
            break
        logits, states = model.forward_with_state(tokens[:, None], states=states, phase="decode",
                                                  want_state=True)
        last = logits[:, -1]
    return new
