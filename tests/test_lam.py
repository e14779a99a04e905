"""The lambda parameterisation."""
import math

import pytest
import torch
from torch import nn

from qedprobe.lam import LAMBDA_MAX, lambda_from_theta, init_theta, param_groups, random_directions


def test_initial_lambda_is_0_25_sigmoid_minus_2():
    lam = lambda_from_theta(init_theta(6))
    assert lam.shape == (6,)
    assert lam[0].item() == pytest.approx(0.25 / (1 + math.exp(2.0)), rel=1e-6)
    assert lam[0].item() == pytest.approx(0.0298, abs=1e-4)
    assert LAMBDA_MAX == 0.25


def test_lambda_is_bounded_by_lambda_max():
    lam = lambda_from_theta(torch.tensor([-50.0, 0.0, 50.0]))
    assert lam.tolist() == pytest.approx([0.0, 0.125, 0.25], abs=1e-12)


def test_random_directions_are_unit_and_reproducible():
    z = random_directions(4, 16, seed=7)
    assert z.shape == (4, 16) and z.dtype == torch.float32
    torch.testing.assert_close(z.norm(dim=-1), torch.ones(4), rtol=0, atol=1e-6)
    assert torch.equal(z, random_directions(4, 16, seed=7))
    assert not torch.equal(z, random_directions(4, 16, seed=8))


def test_param_groups_give_theta_ten_times_the_lr():
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(3, 3)
            self.theta = nn.Parameter(init_theta(2))

    model = nn.Sequential(Mixer(), Mixer())
    model[1].proj.weight.requires_grad_(False)
    groups = {g["name"]: g for g in param_groups(model, lr=3e-4, weight_decay=0.1)}
    assert groups["theta"]["lr"] == pytest.approx(3e-3) and groups["theta"]["weight_decay"] == 0.0
    assert {id(p) for p in groups["theta"]["params"]} == {id(model[0].theta), id(model[1].theta)}
    assert len(groups["main"]["params"]) == 3 and groups["main"]["lr"] == 3e-4


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf")])
def test_bad_lambda_max_refused(bad):
    with pytest.raises(ValueError, match="lambda_max"):
        lambda_from_theta(torch.zeros(2), lambda_max=bad)


def test_check_strengths_range_and_gdn2_rule():
    from qedprobe.lam import check_strengths

    check_strengths([-1, 0, 2], arm="full")
    check_strengths([3.0], arm="full", allow_extrapolation=True)
    check_strengths([1.0], arm="gdn2")
    with pytest.raises(ValueError, match=r"`s` must lie in \[-1.0, 2.0\].*got -1.5..2"):
        check_strengths([-1.5, 2.0], arm="full")
    with pytest.raises(ValueError, match="gdn2"):
        check_strengths([1.0, 0.5], arm="gdn2", allow_extrapolation=True)
