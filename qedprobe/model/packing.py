r"""Prompts packed into one row for a prefill: validated once on the host, moved to the device once.

:func:`pack_prompts` turns an integer tensor ``[B, T]`` (or ``[T]``: one prompt) or a list of non-empty token-id lists into a
:class:`PackedPrompts`: the ids ``[1, sum T]`` and ``cu_seqlens`` ``[N + 1]`` on the device, the
prompt lengths on the host. Validation is vectorised (one pass over the ids in C, no per-token
Python loop) and happens here, so ``generate`` needs no device synchronisation to check ids. A
sweep that runs the same prompts at several strengths packs them once and passes the
:class:`PackedPrompts` to each ``generate`` call.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain

import torch


@dataclass(frozen=True)
class PackedPrompts:
    """``ids`` ``[1, total]`` int64 and ``cu_seqlens`` ``[N + 1]`` int32 on ``ids.device``;
    ``lengths``: the N prompt lengths; ``vocab_size``: the bound the ids were checked against."""

    ids: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: tuple
    vocab_size: int

    @property
    def last_positions(self) -> torch.Tensor:
        """``[N]`` position of each prompt's last token in the packed row."""
        return self.cu_seqlens[1:].long() - 1

    def by_length(self):
        """Per distinct prompt length ``T`` (in order of first appearance): ``(the indices of
        the prompts of that length, their ids [n, T] on the device)``."""
        starts = [0, *accumulate(self.lengths)]
        groups: dict[int, list[int]] = {}
        for i, T in enumerate(self.lengths):
            groups.setdefault(T, []).append(i)
        for T, prompts in groups.items():
            index = torch.tensor([starts[i] for i in prompts])[:, None] + torch.arange(T)
            yield prompts, self.ids[0, index.to(self.ids.device)]


def _flat_ids(prompts) -> tuple[torch.Tensor, tuple]:
    """``(ids [total] int64 on the host or prompts' device, lengths)`` of valid-typed ``prompts``."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2 or prompts.dtype not in (torch.int32, torch.int64) or prompts.numel() == 0:
            raise ValueError(f"generate: tensor `prompts` must be a non-empty integer tensor [B, T] or [T], "
                             f"got {prompts.dtype} {tuple(prompts.shape)}")
        return prompts.reshape(-1).long(), (prompts.shape[1],) * prompts.shape[0]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        hint = " (QEDModel has no tokenizer: encode the text first)" if isinstance(prompts, str) else ""
        raise ValueError(f"generate: `prompts` must be an integer tensor [B, T] or [T], or a non-empty "
                         f"list of token-id lists, got {prompts!r:.80}{hint}")
    if any(not isinstance(p, (list, tuple)) or not p for p in prompts):
        raise ValueError("generate: `prompts` must be a list of non-empty lists of token ids")
    flat = list(chain.from_iterable(prompts))
    if any(t is bool or not issubclass(t, int) for t in set(map(type, flat))):
        bad = [t for t in flat if isinstance(t, bool) or not isinstance(t, int)]
        raise ValueError(f"generate: token ids must be ints, got {bad[:5]}")
    try:
        ids = torch.tensor(flat, dtype=torch.long)
    except (OverflowError, RuntimeError):
        raise ValueError("generate: token ids must be ints that fit in int64") from None
    return ids, tuple(len(p) for p in prompts)


def pack_prompts(prompts, vocab_size: int, device) -> PackedPrompts:
    """Check ``prompts`` (ids in ``[0, vocab_size)``) and pack them on ``device``."""
    if isinstance(prompts, PackedPrompts):
        if prompts.vocab_size > vocab_size or prompts.ids.device != torch.device(device):
            raise ValueError(f"generate: PackedPrompts checked for vocab {prompts.vocab_size} on "
                             f"{prompts.ids.device}, the model has vocab {vocab_size} on {device}")
        return prompts
    ids, lengths = _flat_ids(prompts)
    lo, hi = torch.aminmax(ids)
    if lo < 0 or hi >= vocab_size:
        bad = ids[(ids < 0) | (ids >= vocab_size)][:5].tolist()
        raise ValueError(f"generate: token ids must be ints in [0, {vocab_size}), got {bad}")
    ends = torch.tensor((0, *lengths)).cumsum(0).to(torch.int32)
    return PackedPrompts(ids=ids.to(device)[None], cu_seqlens=ends.to(device), lengths=lengths,
                         vocab_size=vocab_size)
