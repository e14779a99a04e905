"""The reference recurrence ``qed_naive``: worked examples, eq. 11-12, oracles, bad input."""
import math

import numpy as np
import pytest
import torch

from qedprobe.ops import ARMS, PROJECTED_ARMS, qed_chunk_torch, qed_naive, value_checks

from helpers import F64, OP_INPUTS, expanded_naive, grouped_inputs, independent_qed, make_inputs, op_args, z_for


def call(x, **kw):
    return qed_naive(*op_args(x), **kw)


# --- the paper's worked examples -------------------------------------------------------------

def worked_example(arm, lam=0.2):
    """K=2, V=1, k=(1,0), q=(0.6,0.8), b=(0.5,0.5), S_bar=(2,3), w*v=1, no output scale."""
    t = lambda *x: torch.tensor(x, dtype=F64).view(1, 1, 1, -1)  # noqa: E731
    state = torch.tensor([2.0, 3.0], dtype=F64).view(1, 1, 2, 1)
    return qed_naive(t(0.6, 0.8), t(1.0, 0.0), t(1.0), t(0.0, 0.0), t(0.5, 0.5), t(1.0),
                     torch.tensor([lam], dtype=F64), arm=arm, scale=1.0, initial_state=state,
                     output_final_state=True, return_probes=True, use_qk_l2norm=False)


def test_worked_example_gdn2_output_is_3_6():
    o, state, _ = worked_example("gdn2")
    assert o.item() == pytest.approx(3.6, abs=1e-14)
    assert state.flatten().tolist() == pytest.approx([2.0, 3.0], abs=1e-14)


def test_worked_example_qed():
    o, state, p = worked_example("full")
    assert p["d"].flatten().tolist() == pytest.approx([0.0, 0.4], abs=1e-14)
    assert p["Sd"].item() == pytest.approx(1.2, abs=1e-14)
    assert state.flatten().tolist() == pytest.approx([1.76, 3.0], abs=1e-14)
    assert o.item() == pytest.approx(3.456, abs=1e-14)
    assert 3.6 - o.item() == pytest.approx(0.2 * 0.6 * 1.2, abs=1e-14)


def test_non_normal_erase_factor():
    """k=(1,0), b=(0.5,0.5), q=(0,1), lam=0.2: M = [[0.5,-0.1],[0,1]], spectrum {0.5,1}."""
    t = lambda *x: torch.tensor(x, dtype=F64).view(1, 1, 1, -1)  # noqa: E731
    eye = torch.eye(2, dtype=F64).view(1, 1, 2, 2)
    # With no decay and no write, one step maps the identity state to M itself.
    _, M, p = qed_naive(t(0.0, 1.0), t(1.0, 0.0), t(0.0, 0.0), t(0.0, 0.0), t(0.5, 0.5), t(0.0, 0.0),
                        torch.tensor([0.2], dtype=F64), arm="full", initial_state=eye,
                        output_final_state=True, return_probes=True, use_qk_l2norm=False)
    M = M[0, 0]
    assert torch.allclose(M, torch.tensor([[0.5, -0.1], [0.0, 1.0]], dtype=F64), atol=1e-15)
    assert sorted(torch.linalg.eigvals(M).real.tolist()) == pytest.approx([0.5, 1.0], abs=1e-14)
    assert p["e"].item() == pytest.approx(0.5, abs=1e-15)
    norm = torch.linalg.vector_norm(M @ torch.tensor([0.0, 1.0], dtype=F64)).item()
    assert norm == pytest.approx(math.sqrt(1.01), abs=1e-14)
    assert norm > 1.0


# --- eq. 11-12: QED minus GDN-2 from one state -------------------------------------------------

@pytest.mark.parametrize("arm", ARMS)
def test_one_step_difference_equations(arm):
    x = make_inputs(B=2, T=1, H=3, K=6, V=4, seed=1)
    state = torch.randn(2, 3, 6, 4, dtype=F64, generator=torch.Generator().manual_seed(9))
    kw = dict(initial_state=state, output_final_state=True, return_probes=True)
    o, s, p = call(x, arm=arm, z=z_for(arm, 3, 6), **kw)
    o0, s0, _ = call(x, arm="gdn2", **kw)
    lam = x["lam"].view(1, 1, 3, 1)
    k_hat = x["k"] / torch.sqrt((x["k"] ** 2).sum(-1, keepdim=True) + 1e-6)
    ds = -lam[:, 0, :, :, None] * k_hat[:, 0, :, :, None] * p["Sd"][:, 0, :, None, :]
    do = -lam * p["rho"].unsqueeze(-1) * 6 ** -0.5 * p["Sd"]
    torch.testing.assert_close(s - s0, ds, rtol=0, atol=1e-13)
    torch.testing.assert_close(o - o0, do, rtol=0, atol=1e-13)
    if arm != "gdn2":
        assert (s - s0).abs().max() > 1e-3  # the test can fail: the arms really differ


# --- independent float64 oracle ----------------------------------------------------------------

@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("per_token", [False, True])
def test_matches_independent_float64(arm, per_token):
    B, T, H, K, V = 2, 9, 2, 5, 3
    x = make_inputs(B, T, H, K, V, seed=2)
    if per_token:
        x["lam"] = torch.rand(B, T, H, dtype=F64, generator=torch.Generator().manual_seed(4)) - 0.5
    z = z_for(arm, H, K)
    state = torch.randn(B, H, K, V, dtype=F64, generator=torch.Generator().manual_seed(5))
    o, s, _ = call(x, arm=arm, z=z, initial_state=state, output_final_state=True)
    lam = x["lam"].expand(B, T, H) if per_token else x["lam"].expand(T, H)
    for n in range(B):
        arr = {k_: t[n].numpy() for k_, t in x.items() if k_ != "lam"}
        lam_n = (lam[n] if per_token else lam).numpy()
        ro, rs = independent_qed(arr["q"], arr["k"], arr["v"], arr["g"], arr["b"], arr["w"], lam_n,
                                 arm, None if z is None else z.numpy(), state=state[n].numpy())
        np.testing.assert_allclose(o[n].numpy(), ro, rtol=0, atol=1e-9)
        np.testing.assert_allclose(s[n].numpy(), rs, rtol=0, atol=1e-9)


# --- fla's own GDN-2 reference -----------------------------------------------------------------

@pytest.mark.parametrize("how", ["arm_gdn2", "lam_zero"])
def test_equals_fla_gdn2_reference(how):
    fla_naive = pytest.importorskip("fla.ops.gdn2.naive", reason="fla-core not installed (pip install -e .[oracle])")
    x = make_inputs(B=2, T=16, H=2, K=8, V=6, dtype=torch.float32, seed=6)
    state = torch.randn(2, 2, 8, 6, generator=torch.Generator().manual_seed(7))
    arm, lam = ("gdn2", x["lam"]) if how == "arm_gdn2" else ("full", torch.zeros_like(x["lam"]))
    o, s, _ = qed_naive(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], lam, arm=arm,
                        initial_state=state, output_final_state=True)
    unit = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    ro, rs = fla_naive.naive_recurrent_gdn2(unit(x["q"]), unit(x["k"]), x["v"], x["g"], x["b"], x["w"],
                                            initial_state=state, output_final_state=True)
    torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=1e-5)


# --- the erase eigenvalue ----------------------------------------------------------------------

@pytest.mark.parametrize("arm", PROJECTED_ARMS)
@pytest.mark.parametrize("lam", [-3.0, 0.25, 10.0])
def test_projected_arms_keep_e_in_unit_interval(arm, lam):
    x = make_inputs(B=2, T=20, H=3, K=8, V=4, seed=8)
    x["lam"] = torch.full((3,), lam, dtype=F64)
    _, _, p = call(x, arm=arm, z=z_for(arm, 3, 8), return_probes=True)
    assert bool((p["e"] > 0).all()) and bool((p["e"] < 1).all())
    # With exactly unit keys the projection is exact and e_t = 1 - sum_i b_i k_i^2.
    x["q"], x["k"] = (t / t.norm(dim=-1, keepdim=True) for t in (x["q"], x["k"]))
    _, _, p = call(x, arm=arm, z=z_for(arm, 3, 8), return_probes=True, use_qk_l2norm=False)
    torch.testing.assert_close(p["e"], 1 - (x["b"] * x["k"] ** 2).sum(-1), rtol=0, atol=1e-14)


@pytest.mark.parametrize("arm", ["nogate_noproj", "noproj"])
def test_unprojected_arms_move_e_within_bound(arm):
    x = make_inputs(B=2, T=50, H=3, K=4, V=2, seed=10)
    x["lam"] = torch.full((3,), 0.25, dtype=F64)
    _, _, p = call(x, arm=arm, return_probes=True)
    k_hat = x["k"] / torch.sqrt((x["k"] ** 2).sum(-1, keepdim=True) + 1e-6)
    e_gdn2 = 1 - (x["b"] * k_hat ** 2).sum(-1)
    assert (p["e"] - e_gdn2).abs().max() > 1e-2
    assert bool((p["e"] >= -0.25).all()) and bool((p["e"] <= 1.25).all())


# --- state carry, per-token lam, packing, gradients --------------------------------------------

def test_two_halves_with_state_equal_one_run():
    x = make_inputs(B=2, T=14, seed=11)
    o, s, p = call(x, output_final_state=True, return_probes=True)
    first = {n: t[:, :6] if t.dim() > 1 else t for n, t in x.items()}
    second = {n: t[:, 6:] if t.dim() > 1 else t for n, t in x.items()}
    o1, s1, p1 = call(first, output_final_state=True, return_probes=True)
    o2, s2, p2 = call(second, initial_state=s1, output_final_state=True, return_probes=True)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, rtol=0, atol=1e-13)
    torch.testing.assert_close(s2, s, rtol=0, atol=1e-13)
    torch.testing.assert_close(torch.cat([p1["Sd"], p2["Sd"]], 1), p["Sd"], rtol=0, atol=1e-13)


def test_per_token_lam_equal_to_per_head_when_constant_and_acts_per_token():
    x = make_inputs(B=2, T=10, H=3, seed=12)
    o, _, _ = call(x)
    per_token = x["lam"].expand(2, 10, 3).clone()
    o_pt, _, _ = call({**x, "lam": per_token})
    torch.testing.assert_close(o_pt, o, rtol=0, atol=0)
    per_token[:, 5:] = 0.0  # lam only for the first five tokens
    o_cut, _, _ = call({**x, "lam": per_token})
    torch.testing.assert_close(o_cut[:, :5], o[:, :5], rtol=0, atol=0)
    assert (o_cut[:, 5:] - o[:, 5:]).abs().max() > 1e-4


def test_d_override_replaces_the_direction():
    x = make_inputs(B=1, T=8, H=2, K=6, seed=13)
    _, _, p = call(x, arm="full", return_probes=True)
    o, _, _ = call(x, arm="full")
    o_same, _, _ = call(x, arm="gdn2", d=p["d"])
    torch.testing.assert_close(o_same, o, rtol=0, atol=1e-14)
    d_new = torch.randn(1, 8, 2, 6, dtype=F64)
    _, _, p_new = call(x, arm="full", d=d_new, return_probes=True)
    torch.testing.assert_close(p_new["d"], d_new, rtol=0, atol=0)


def test_cu_seqlens_packing_equals_separate_runs():
    lengths = [5, 1, 9]
    parts = [make_inputs(B=1, T=n, seed=20 + i) for i, n in enumerate(lengths)]
    for p_ in parts:
        p_["lam"] = parts[0]["lam"]
    packed = {n: torch.cat([p_[n] for p_ in parts], 1) if n != "lam" else parts[0]["lam"] for n in parts[0]}
    states = torch.randn(3, 3, 8, 5, dtype=F64, generator=torch.Generator().manual_seed(14))
    cu = torch.tensor([0, 5, 6, 15])
    o, s, p = call(packed, cu_seqlens=cu, initial_state=states, output_final_state=True, return_probes=True)
    for i, part in enumerate(parts):
        oi, si, pi = call(part, initial_state=states[i:i + 1], output_final_state=True, return_probes=True)
        span = slice(int(cu[i]), int(cu[i + 1]))
        torch.testing.assert_close(o[:, span], oi, rtol=0, atol=0)
        torch.testing.assert_close(s[i:i + 1], si, rtol=0, atol=0)
        torch.testing.assert_close(p["Sd"][:, span], pi["Sd"], rtol=0, atol=0)


def test_float64_gradients_flow():
    x = make_inputs(B=1, T=4, H=1, K=3, V=2, seed=15)
    x = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    state = torch.randn(1, 1, 3, 2, dtype=F64, requires_grad=True)

    def f(q, k, v, g, b, w, lam, s0):
        o, s, _ = qed_naive(q, k, v, g, b, w, lam, initial_state=s0, output_final_state=True)
        return o, s

    assert torch.autograd.gradcheck(f, (*x.values(), state), eps=1e-6, atol=1e-7)


def test_output_and_state_dtypes():
    x = make_inputs(B=1, T=3, H=2, K=4, V=4, dtype=torch.bfloat16, seed=16)
    o, s, p = call(x, output_final_state=True, return_probes=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in p.values())
    assert call(x)[1] is None and call(x)[2] is None


# --- bad input ---------------------------------------------------------------------------------

def bad_cases():
    x = make_inputs(B=2, T=4, H=2, K=4, V=3)
    yield "k", {**x, "k": x["k"][:, :3]}, {}
    yield "v", {**x, "v": x["v"][..., 0]}, {}
    yield "g", {**x, "g": x["g"].float()}, {}
    yield "b", {**x, "b": x["b"].long()}, {}
    yield "w", {**x, "w": x["w"][:, :, :1]}, {}
    yield "lam", {**x, "lam": torch.zeros(3, dtype=F64)}, {}
    yield "lam", {**x, "lam": 0.1}, {}
    yield "arm", x, {"arm": "qed"}
    yield "z", x, {"arm": "rand"}
    yield "z", x, {"arm": "rand", "z": torch.ones(2, 3, dtype=F64)}
    yield "z", x, {"arm": "full", "z": torch.ones(2, 4, dtype=F64)}
    yield "d", x, {"d": torch.ones(2, 4, 2, 3, dtype=F64)}
    yield "initial_state", x, {"initial_state": torch.zeros(2, 2, 4, 3)}
    yield "initial_state", x, {"initial_state": torch.zeros(1, 2, 4, 3, dtype=F64)}
    yield "scale", x, {"scale": -1.0}
    yield "cu_seqlens", x, {"cu_seqlens": torch.tensor([0, 4])}
    one = {n: t[:1] if t.dim() > 1 else t for n, t in x.items()}
    yield "cu_seqlens", one, {"cu_seqlens": torch.tensor([0, 3])}
    yield "cu_seqlens", one, {"cu_seqlens": torch.tensor([0.0, 4.0])}


@pytest.mark.parametrize("name,x,kw", list(bad_cases()))
def test_bad_input_is_refused_naming_the_argument(name, x, kw):
    with pytest.raises(ValueError, match=f"`{name}`"):
        call(x, **kw)


@pytest.mark.parametrize("name", ["q", "v", "g", "lam"])
def test_non_finite_inputs_refused_when_checking(name):
    x = make_inputs(B=1, T=3, H=2, K=4, V=3)
    bad = x[name].clone()
    bad.view(-1)[0] = float("nan")
    x[name] = bad
    call(x)  # not asked to check: runs
    with value_checks(), pytest.raises(ValueError, match=f"`{name}` contains NaN"):
        call(x)


def test_positive_log_decay_refused_when_checking():
    x = make_inputs(B=1, T=3, H=2, K=4, V=3)
    x["g"] = x["g"].abs() + 0.1
    with value_checks(), pytest.raises(ValueError, match="`g`.*<= 0"):
        call(x)


# --- grouped value heads (HV = m * H) --------------------------------------------------------

@pytest.mark.parametrize("op", [qed_naive, qed_chunk_torch])
def test_grouped_value_heads_equal_expanded_query_and_key(op):
    x = grouped_inputs(B=2, T=37, H=2, HV=6, K=8, V=5, seed=60, lam_token=True)
    kw = dict(arm="rand", z=z_for("rand", 6, 8), initial_state=torch.randn(2, 6, 8, 5, dtype=F64),
              output_final_state=True, return_probes=True)
    got = op(*op_args(x), **kw)
    ref = expanded_naive(x, **kw)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-12)
    for name in ("rho", "d", "Sd", "e"):
        torch.testing.assert_close(got[2][name], ref[2][name], rtol=0, atol=1e-12)
    assert got[2]["rho"].shape == (2, 37, 6)


def test_grouped_gradients_of_q_and_k_sum_over_the_group():
    x = grouped_inputs(B=1, T=9, H=1, HV=2, K=4, V=3, seed=61)
    q = x["q"].clone().requires_grad_()
    o = qed_naive(q, *(x[n] for n in OP_INPUTS[1:]), arm="full")[0]
    (dq,) = torch.autograd.grad(o.sum(), q)
    per_head = []
    for j in range(2):  # each value head on its own, with the shared query/key head
        qj = x["q"].clone().requires_grad_()
        sl = {n: x[n][:, :, j:j + 1] for n in ("v", "g", "b", "w")}
        oj = qed_naive(qj, x["k"], sl["v"], sl["g"], sl["b"], sl["w"], x["lam"][j:j + 1], arm="full")[0]
        per_head.append(torch.autograd.grad(oj.sum(), qj)[0])
    torch.testing.assert_close(dq, per_head[0] + per_head[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("op", [qed_naive, qed_chunk_torch])
def test_value_heads_not_a_multiple_of_query_heads_are_refused(op):
    x = grouped_inputs(B=1, T=4, H=2, HV=3, K=4, V=3, seed=62)
    with pytest.raises(ValueError, match=r"`v` \(HV=3\) must be a multiple of the query/key heads of `q` \(H=2\)"):
        op(*op_args(x))
