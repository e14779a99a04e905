"""Teacher-forced answer log-likelihood."""
import math

import pytest
import torch

from qedprobe.eval.likelihood import answer_logprob
from qedprobe.tasks import make_task
from qedprobe.model import QEDConfig, QEDModel, strength


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return QEDModel(QEDConfig(vocab_size=259, hidden_size=32, num_hidden_layers=1, num_heads=2, head_dim=16,
                              arm="full")).double()


def test_answer_logprob_is_the_sum_of_token_logprobs(model):
    sample = make_task("s-niah-1", format="legacy").sample(400, 0, samples=1)
    answer = list((" " + sample.answer).encode())
    ids = torch.tensor([list(sample.input_ids) + answer])
    logits = model(ids)[0]
    expected = sum(torch.log_softmax(logits[len(sample.input_ids) - 1 + i], -1)[tok].item()
                   for i, tok in enumerate(answer))
    assert answer_logprob(model, sample) == pytest.approx(expected, abs=1e-10)
    assert len(answer) == 8 and expected < 0 and math.isfinite(expected)


def test_answer_logprob_sees_the_strength_block(model):
    sample = make_task("s-niah-1", format="legacy").sample(400, 1, samples=2)
    base = answer_logprob(model, sample)
    with strength(model, 2.0):
        scaled = answer_logprob(model, sample)
    assert scaled != base
    with strength(model, 1.0):
        assert answer_logprob(model, sample) == base
