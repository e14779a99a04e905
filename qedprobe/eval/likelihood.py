"""Teacher-forced answer log-likelihood: a graded retrieval score for models that rarely get
the exact string right (small or early checkpoints), paired across interventions.

``answer_logprob(model, sample)`` = ``sum_i log p(answer_i | prompt, answer_<i)`` over the answer
tokens (the value as the task tokenizes `` {value}``), from one forward pass. Hooks and
``strength`` blocks active around the call apply (it is a prefill pass).
"""
from __future__ import annotations

import torch

from qedprobe.tokenizer import load_tokenizer


@torch.no_grad()
def answer_logprob(model, sample, tokenizer="bytes") -> float:
    """Log-probability (nats) of ``" " + sample.answer`` after ``sample.input_ids``."""
    answer = load_tokenizer(tokenizer).encode(" " + sample.answer)
    if not answer:
        raise ValueError(f"answer_logprob: the answer {sample.answer!r} encodes to no tokens")
    ids = torch.tensor([list(sample.input_ids) + answer], device=model.device)
    logp = torch.log_softmax(model(ids)[0, -len(answer) - 1:-1].double(), dim=-1)
    return float(logp.gather(-1, torch.tensor(answer, device=logp.device)[:, None]).sum())
