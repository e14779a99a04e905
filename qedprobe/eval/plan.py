"""A sweep's batches: which rows are still missing, and how many prompts one generate call takes.

:func:`plan_batches` packs the missing ``(length, s, sample_id)`` of a folder into batches of one
length, each packed once and run at every strength it still owes; the plan depends only on what
is missing, so every rank of a distributed sweep computes the same one and takes its share.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .store import strength_key

__all__ = ["SweepBatch", "plan_batches", "still_missing", "default_batch_size", "MAX_BATCH_TOKENS",
           "prefill_bytes_per_token", "memory_batch_tokens"]


@dataclass
class SweepBatch:
    """One batch of prompts of one length, packed once: ``sample_ids``, and per strength the
    ids whose rows are still missing (``todo``: ``[(s, ids)]``, one generate call each)."""

    length: int
    sample_ids: list[int]
    todo: list[tuple[float, list[int]]]


def plan_batches(done, lengths, strengths, samples, batch_size_of) -> list[SweepBatch]:
    """The batches that compute every ``(length, s, sample_id)`` not in ``done``: per length,
    the sample ids missing at some strength, in runs of ``batch_size_of(length)``."""
    batches = []
    for L in lengths:
        missing = {i: [s for s in strengths if (L, strength_key(s), i) not in done] for i in range(samples)}
        ids = [i for i in range(samples) if missing[i]]
        bs = batch_size_of(L)
        for start in range(0, len(ids), bs):
            chunk = ids[start:start + bs]
            todo = [(s, [i for i in chunk if s in missing[i]]) for s in strengths]
            batches.append(SweepBatch(L, chunk, [(s, who) for s, who in todo if who]))
    return batches


def still_missing(batches, done) -> list[SweepBatch]:
    """``batches`` less the rows now in ``done`` (a batch left with nothing to do is dropped):
    what a rank still owes of the batches it was dealt."""
    left = []
    for b in batches:
        todo = [(s, [i for i in who if (b.length, strength_key(s), i) not in done]) for s, who in b.todo]
        todo = [(s, who) for s, who in todo if who]
        if todo:
            left.append(SweepBatch(b.length, b.sample_ids, todo))
    return left


def default_batch_size(length, device_type, batch_tokens) -> int:
    """Prompts per generate call: ``batch_tokens // length`` on CUDA, 4 elsewhere."""
    if device_type == "cuda":
        return max(1, int(batch_tokens) // int(length))
    return 4


MAX_BATCH_TOKENS = 2 ** 20
"""The most prompt tokens :func:`memory_batch_tokens` packs into one call: the recurrence's
Triton kernels compute element offsets ``token x heads x head_dim`` in int32, which stays below
2^31 for ``heads x head_dim <= 2048`` (768 for the 340M shape)."""


def prefill_bytes_per_token(cfg) -> int:
    """A bound on a prefill's live activation bytes per prompt token of a ``QEDConfig`` model:
    the widest tensors one block holds at once (bf16 projections and MLP, float32 log-decay and
    the recurrence's intra-chunk buffers, float32 residual and norms): an upper bound, so that a
    batch sized by it fits whatever the path (docs/BENCHMARKS.md has the measured peaks)."""
    hk = cfg.num_heads * max(cfg.head_dim, cfg.head_v_dim)
    wide = 3 * cfg.intermediate_size + 2 * (5 * hk + 2 * cfg.head_v_dim)
    return 2 * wide + 4 * 7 * hk + 8 * cfg.hidden_size


def memory_batch_tokens(model, share: float = 0.6) -> int:
    """Prompt tokens per generate call on a CUDA device: the largest power of two whose prefill
    (:func:`prefill_bytes_per_token`) fits in ``share`` of the device's free memory, at most
    :data:`MAX_BATCH_TOKENS` and at least 2^14."""
    free, _ = torch.cuda.mem_get_info(model.device)
    fit = int(share * free) // prefill_bytes_per_token(model.cfg)
    return max(2 ** 14, min(MAX_BATCH_TOKENS, 1 << max(fit, 1).bit_length() - 1))
