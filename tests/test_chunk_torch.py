"""The chunked PyTorch path (CPU default of ``qed_attention``) against the float64 reference."""
import pytest
import torch

from qedprobe.ops import ARMS, qed_attention, qed_chunk_torch, qed_naive

from helpers import F64, assert_outputs_close, make_inputs, op_args, z_for


def both(x, **kw):
    kw = dict(output_final_state=True, return_probes=True, **kw)
    return qed_chunk_torch(*op_args(x), **kw), qed_naive(*op_args(x), **kw)


@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_with_state_and_ragged_length(arm):
    x = make_inputs(B=2, T=71, H=2, K=8, V=6, seed=30)
    z = z_for(arm, 2, 8, seed=1)
    state = torch.randn(2, 2, 8, 6, dtype=F64, generator=torch.Generator().manual_seed(31))
    assert_outputs_close(*both(x, arm=arm, z=z, initial_state=state), atol=1e-12)


def test_per_token_lam_d_override_and_strong_decay():
    x = make_inputs(B=1, T=40, H=2, K=4, V=3, seed=32, gmin=20.0)
    x["g"][:, 5] = 0.0
    x["lam"] = torch.rand(1, 40, 2, dtype=F64) - 0.5
    d = torch.randn(1, 40, 2, 4, dtype=F64)
    assert_outputs_close(*both(x, d=d), atol=1e-12)


def test_packed_sequences():
    x = make_inputs(B=1, T=50, H=2, K=4, V=3, seed=33)
    assert_outputs_close(*both(x, cu_seqlens=torch.tensor([0, 7, 40, 50])), atol=1e-12)


def assert_gradients_match_the_reference(x):
    """Gradients of every input through ``o`` and the final state: chunked path vs ``qed_naive``."""
    grads = []
    for op in (qed_chunk_torch, qed_naive):
        leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        o, s, _ = op(*leaves.values(), output_final_state=True)
        (o.square().sum() + s.sum()).backward()
        grads.append({n: t.grad for n, t in leaves.items()})
    for name in x:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=1e-10)


def test_decay_formed_in_blocks_of_chunks(monkeypatch):
    """With ``Dec`` formed a few chunks at a time (a block smaller than one sequence's chunks,
    not dividing them) the outputs, probes and gradients equal the reference."""
    from qedprobe.kernels.qed import chunk_torch
    x = make_inputs(B=2, T=150, H=2, K=4, V=3, seed=36)
    per_chunk = 2 * 2 * chunk_torch.CHUNK * chunk_torch.SUB * 4  # B * H * CHUNK * SUB * K
    monkeypatch.setattr(chunk_torch, "SCORE_BLOCK", 2 * per_chunk)  # 2 of 5 chunks
    assert_outputs_close(*both(x), atol=1e-12)
    assert_gradients_match_the_reference(x)


def test_gradients_equal_the_reference():
    assert_gradients_match_the_reference(make_inputs(B=1, T=37, H=2, K=4, V=3, seed=34))


def test_dispatcher_uses_the_chunked_path_on_cpu_and_refuses_unknown_modes():
    x = make_inputs(B=1, T=9, seed=35)
    torch.testing.assert_close(qed_attention(*op_args(x))[0], qed_chunk_torch(*op_args(x))[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="`mode`"):
        qed_attention(*op_args(x), mode="fast")


def test_dispatcher_refuses_an_in_place_state_where_the_recurrent_op_does_not_run():
    # CPU, one token: the token loop runs, which has no in-place update; the error names the mode.
    x = make_inputs(B=1, T=1, H=2, K=8, V=8, seed=3)
    h0 = torch.zeros(1, 2, 8, 8, dtype=F64)
    with pytest.raises(ValueError, match="needs the recurrent op.*'naive'"):
        qed_attention(*op_args(x), initial_state=h0, output_final_state=True, inplace_final_state=True)


def test_dispatcher_errors_name_the_function_called_and_the_op_it_ran():
    x = make_inputs(B=1, T=9, seed=35)
    x["lam"] = x["lam"][:1]
    with pytest.raises(ValueError, match=r"^qed_attention \(mode 'torch'\): `lam`") as err:
        qed_attention(*op_args(x))
    assert "qed_chunk_torch" not in str(err.value)
