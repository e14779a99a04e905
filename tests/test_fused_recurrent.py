"""``qed_recurrent`` (Triton, token by token) against the reference ``qed_naive``.

On CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), with
CUDA on the GPU: float64 inputs must match the float64 reference to ~1e-12 either way.
``TestGPU`` (long sequences, bf16, fla) runs only with CUDA.
"""
from functools import partial

import pytest
import torch

from qedprobe.kernels.qed.fused_recurrent import default_block_config, qed_recurrent
from qedprobe.ops import ARMS, qed_naive

from helpers import (DEVICE, F64, assert_close, assert_outputs_close, expanded_naive, grouped_inputs, make_inputs,
                     op_args, rel_err, z_for)

TIGHT = dict(rtol=1e-12, atol=1e-12)
recurrent_inputs = partial(make_inputs, H=2, K=24, V=24, gmin=0.5, device=DEVICE)
"""These tests' default sizes and decay; every call may override them."""


def random_state(N, H, K, V, seed, dtype=F64, device=DEVICE):
    return torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(seed), dtype=F64).to(device, dtype)


def both(x, **kw):
    """``(qed_recurrent(...), qed_naive(...))`` on the same inputs."""
    return qed_recurrent(*op_args(x), **kw), qed_naive(*op_args(x), **kw)


# --- float64 in the interpreter: equal to the reference ------------------------------------------

@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_and_probe_matches_naive(arm):
    # K = V = 24: padded to 32 with masks; float64 uses BV = 16, so two value blocks share a head.
    x = recurrent_inputs(seed=1)
    kw = dict(arm=arm, z=z_for(arm, 2, 24, device=DEVICE), initial_state=random_state(2, 2, 24, 24, seed=2),
              output_final_state=True, return_probes=True)
    got, ref = both(x, **kw)
    assert_outputs_close(got, ref, **TIGHT)
    assert got[0].dtype == F64 and got[1].dtype == F64
    assert all(t.dtype == F64 for t in got[2].values())


def test_worked_example_from_the_paper():
    """K=2, V=1, k=(1,0), q=(0.6,0.8), b=(0.5,0.5), S_bar=(2,3), w*v=1, lam=0.2: output 3.456."""
    t = lambda *x: torch.tensor(x, dtype=F64, device=DEVICE).view(1, 1, 1, -1)  # noqa: E731
    o, s, p = qed_recurrent(t(0.6, 0.8), t(1.0, 0.0), t(1.0), t(0.0, 0.0), t(0.5, 0.5), t(1.0),
                            torch.tensor([0.2], dtype=F64, device=DEVICE), arm="full", scale=1.0,
                            initial_state=torch.tensor([2.0, 3.0], dtype=F64, device=DEVICE).view(1, 1, 2, 1),
                            output_final_state=True, return_probes=True, use_qk_l2norm=False)
    assert o.item() == pytest.approx(3.456, abs=1e-14)
    torch.testing.assert_close(s.flatten().cpu(), torch.tensor([1.76, 3.0], dtype=F64), **TIGHT)
    assert p["rho"].item() == pytest.approx(0.6, abs=1e-14)
    torch.testing.assert_close(p["d"].flatten().cpu(), torch.tensor([0.0, 0.4], dtype=F64), **TIGHT)
    assert p["Sd"].item() == pytest.approx(1.2, abs=1e-14)
    assert p["e"].item() == pytest.approx(0.5, abs=1e-14)


@pytest.mark.parametrize("arm", ["full", "nogate_noproj"])
def test_per_token_lam(arm):
    x = recurrent_inputs(K=16, V=16, seed=3)
    x["lam"] = torch.rand(2, 12, 2, dtype=F64, generator=torch.Generator().manual_seed(4)).to(DEVICE) - 0.5
    assert_outputs_close(*both(x, arm=arm, output_final_state=True, return_probes=True), **TIGHT)


def test_d_override_is_used_as_given():
    x = recurrent_inputs(K=16, V=16, seed=5)
    d = torch.randn(2, 12, 2, 16, dtype=F64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    got, ref = both(x, arm="gdn2", d=d, output_final_state=True, return_probes=True)
    assert_outputs_close(got, ref, **TIGHT)
    torch.testing.assert_close(got[2]["d"], d, rtol=0, atol=0)
    plain, _ = both(x, arm="gdn2", output_final_state=True)
    assert rel_err(plain[0], got[0]) > 1e-3  # the direction really changed the output


def test_no_l2norm_and_custom_scale():
    x = recurrent_inputs(K=16, V=24, seed=7)
    x["q"], x["k"] = 0.3 * x["q"], 0.3 * x["k"]
    got, ref = both(x, arm="noproj", scale=0.7, use_qk_l2norm=False, output_final_state=True,
                    return_probes=True)
    assert_outputs_close(got, ref, **TIGHT)


def test_two_halves_with_state_equal_one_run():
    x = recurrent_inputs(T=16, seed=8)
    h0 = random_state(2, 2, 24, 24, seed=9)
    o, s, p = qed_recurrent(*x.values(), initial_state=h0, output_final_state=True, return_probes=True)
    half = lambda sl: [t[:, sl] if t.dim() == 4 else t for t in x.values()]  # noqa: E731
    o1, s1, p1 = qed_recurrent(*half(slice(0, 7)), initial_state=h0, output_final_state=True, return_probes=True)
    o2, s2, p2 = qed_recurrent(*half(slice(7, 16)), initial_state=s1, output_final_state=True, return_probes=True)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, **TIGHT)
    torch.testing.assert_close(s2, s, **TIGHT)
    torch.testing.assert_close(torch.cat([p1["Sd"], p2["Sd"]], 1), p["Sd"], **TIGHT)


def test_in_place_decode_steps_write_over_the_state_and_equal_one_run():
    # Grouped value heads (HV = 2 H), several value blocks per head, probes on: every program
    # reads its block of the state before writing it, so the in-place update is exact.
    x = grouped_inputs(B=2, T=5, H=1, HV=2, K=16, V=40, seed=12, device=DEVICE)
    h0 = random_state(2, 2, 16, 40, seed=13)
    o, s, p = qed_recurrent(*x.values(), initial_state=h0, output_final_state=True, return_probes=True)
    state, outs, sds = h0.clone(), [], []
    for t in range(5):
        step = [v[:, t:t + 1] if v.dim() >= 3 else v for v in x.values()]
        o_t, s_t, p_t = qed_recurrent(*step, initial_state=state, output_final_state=True, return_probes=True,
                                      inplace_final_state=True)
        assert s_t is state
        outs.append(o_t)
        sds.append(p_t["Sd"])
    torch.testing.assert_close(torch.cat(outs, 1), o, **TIGHT)
    torch.testing.assert_close(torch.cat(sds, 1), p["Sd"], **TIGHT)
    torch.testing.assert_close(state, s, **TIGHT)


def test_in_place_state_requests_that_cannot_update_are_refused():
    x = recurrent_inputs(T=1, seed=14)
    h0 = random_state(2, 2, 24, 24, seed=15)
    with pytest.raises(ValueError, match="needs `output_final_state=True`"):
        qed_recurrent(*x.values(), initial_state=h0, inplace_final_state=True)
    with pytest.raises(ValueError, match="needs an `initial_state`"):
        qed_recurrent(*x.values(), output_final_state=True, inplace_final_state=True)
    strided = h0.transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(ValueError, match="contiguous `initial_state`"):
        qed_recurrent(*x.values(), initial_state=strided, output_final_state=True, inplace_final_state=True)


def test_decode_steps_equal_one_run():
    x = recurrent_inputs(T=6, K=16, V=16, seed=10)
    x["lam"] = torch.rand(2, 6, 2, dtype=F64, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    o, s, _ = qed_recurrent(*x.values(), output_final_state=True)
    state, outs = None, []
    for t in range(6):
        step = [v[:, t:t + 1] if v.dim() >= 3 else v for v in x.values()]
        o_t, state, _ = qed_recurrent(*step, initial_state=state, output_final_state=True)
        outs.append(o_t)
    torch.testing.assert_close(torch.cat(outs, 1), o, **TIGHT)
    torch.testing.assert_close(state, s, **TIGHT)


def test_cu_seqlens_equals_separate_runs():
    lengths = [5, 1, 9]
    parts = [recurrent_inputs(B=1, T=n, K=16, V=24, seed=20 + i) for i, n in enumerate(lengths)]
    packed = {n: torch.cat([p_[n] for p_ in parts], 1) if n != "lam" else parts[0]["lam"] for n in parts[0]}
    states = random_state(3, 2, 16, 24, seed=14)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32, device=DEVICE)
    kw = dict(arm="rand", z=z_for("rand", 2, 16, device=DEVICE), output_final_state=True, return_probes=True)
    got, ref = both(packed, cu_seqlens=cu, initial_state=states, **kw)
    assert_outputs_close(got, ref, **TIGHT)
    o, s, p = got
    for i, part in enumerate(parts):
        part["lam"] = packed["lam"]
        oi, si, pi = qed_recurrent(*part.values(), initial_state=states[i:i + 1], **kw)
        span = slice(int(cu[i]), int(cu[i + 1]))
        torch.testing.assert_close(o[:, span], oi, **TIGHT)
        torch.testing.assert_close(s[i:i + 1], si, **TIGHT)
        for name in pi:
            torch.testing.assert_close(p[name][:, span], pi[name], **TIGHT)


@pytest.mark.parametrize("arm,varlen", [("full", False), ("rand", True)])
def test_grouped_value_heads(arm, varlen):
    """HV = 2 H value heads against qed_naive on expanded q, k: prefill with probes (packed
    sequences, per-token lam in the second case), then a decode step from its final state."""
    x = grouped_inputs(B=1, T=14, H=2, HV=4, K=16, V=24, seed=16, lam_token=varlen, device=DEVICE)
    h0 = random_state(2 if varlen else 1, 4, 16, 24, seed=17)
    kw = dict(arm=arm, z=z_for(arm, 4, 16, device=DEVICE), initial_state=h0, output_final_state=True, return_probes=True,
              cu_seqlens=torch.tensor([0, 5, 14], device=DEVICE) if varlen else None)
    got = qed_recurrent(*op_args(x), **kw)
    assert_outputs_close(got, expanded_naive(x, **kw), **TIGHT)
    if not varlen:
        step = grouped_inputs(B=1, T=1, H=2, HV=4, K=16, V=24, seed=18, device=DEVICE)
        kw.update(initial_state=got[1])
        assert_outputs_close(qed_recurrent(*op_args(step), **kw), expanded_naive(step, **kw), **TIGHT)


def test_without_state_or_probes_returns_none():
    x = recurrent_inputs(T=4, K=16, V=16, seed=15)
    (o, s, p), (ro, _, _) = both(x)
    assert s is None and p is None
    torch.testing.assert_close(o, ro, **TIGHT)


def test_non_contiguous_inputs():
    x = recurrent_inputs(T=5, K=16, V=16, seed=16)
    x = {n: t.transpose(1, 2).contiguous().transpose(1, 2) if t.dim() == 4 else t for n, t in x.items()}
    assert not x["q"].is_contiguous()
    assert_outputs_close(*both(x, output_final_state=True), **TIGHT)


@pytest.mark.parametrize("B,T", [(2, 1), (2, 3), (1, 4)])
def test_split_projection_views_are_read_in_place(B, T):
    """q, k, v as transformers hands them, views of one ``[B, T, (2 H + HV) K]`` projection split
    along its last axis: read at their token stride without a copy, with the very result of
    contiguous copies (also varlen, ``B = 1``); any other layout is copied first."""
    from qedprobe.kernels.qed.fused_recurrent import token_rows
    H, HV, K = 2, 4, 8
    x = recurrent_inputs(B=B, T=T, H=HV, K=K, V=K, seed=21)
    qkv = torch.randn(B, T, (2 * H + HV) * K, dtype=F64, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    q, k, v = (y.view(B, T, -1, K) for y in torch.split(qkv, [H * K, H * K, HV * K], dim=-1))
    assert token_rows(q) == (q, (2 * H + HV) * K) and not q.is_contiguous()
    cu_seqlens = torch.tensor([0, 1, T]) if B == 1 else None
    N = B if cu_seqlens is None else 2
    kw = dict(initial_state=random_state(N, HV, K, K, seed=23), output_final_state=True, return_probes=True,
              cu_seqlens=cu_seqlens)
    gates = [x[n] for n in ("g", "b", "w", "lam")]
    got = qed_recurrent(q, k, v, *gates, **kw)
    ref = qed_recurrent(q.contiguous(), k.contiguous(), v.contiguous(), *gates, **kw)
    assert_outputs_close(got, ref, rtol=0, atol=0)
    assert got[0].is_contiguous()
    heads_apart = q.transpose(1, 2).contiguous().transpose(1, 2)
    copy, stride = token_rows(heads_apart)
    assert copy.is_contiguous() and stride == H * K and torch.equal(copy, q)


# --- lower precision in the interpreter: float32 state against the float64 reference -----------

@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_low_precision_against_float64(dtype, bound):
    x = recurrent_inputs(T=20, K=16, V=24, dtype=dtype, seed=17)
    h0 = random_state(2, 2, 16, 24, seed=18, dtype=torch.float32)
    o, s, p = qed_recurrent(*x.values(), arm="full", initial_state=h0, output_final_state=True, return_probes=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in p.values())
    x64 = {n: t.double() for n, t in x.items()}
    ro, rs, rp = qed_naive(*x64.values(), arm="full", initial_state=h0.double(), output_final_state=True,
                           return_probes=True)
    assert_close("o", o, ro, bound)
    assert_close("state", s, rs, 1e-5)
    for name in p:
        assert_close(name, p[name], rp[name], 1e-5)


def test_block_config_sets_the_launch_and_keeps_the_result():
    """V = 24 as three value slices of 8, or one slice of 32 with 8 masked lanes."""
    x = recurrent_inputs(T=5, seed=3)
    kw = dict(initial_state=random_state(2, 2, 24, 24, 4), output_final_state=True, return_probes=True)
    ref = qed_naive(*op_args(x), **kw)
    assert default_block_config(24, 24, F64, 4) == (16, 4)
    assert default_block_config(128, 128, torch.float32, 96) == (32, 2)
    assert default_block_config(128, 128, torch.float32, 3000) == (64, 2)
    assert default_block_config(256, 256, torch.float32, 3000) == (32, 2)
    for config in ((8, 2), (32, 1)):
        assert_outputs_close(qed_recurrent(*op_args(x), **kw, block_config=config), ref, **TIGHT)
    for bad in ((12, 4), (64, 4), (16, 3), [16, 4], (16,)):
        with pytest.raises(ValueError, match=r"`block_config` must be a tuple \(BV, num_warps\)"):
            qed_recurrent(*op_args(x), block_config=bad)


def test_bad_input_is_refused_by_name():
    x = recurrent_inputs(T=2, K=8, V=8)
    with pytest.raises(ValueError, match=r"qed_recurrent: `k`"):
        qed_recurrent(x["q"], x["k"][:, :1], *[x[n] for n in ("v", "g", "b", "w", "lam")])
    big = recurrent_inputs(B=1, T=1, H=1, K=8, V=260)
    with pytest.raises(ValueError, match="at most 256"):
        qed_recurrent(*big.values())


def test_equal_calls_share_one_problem_and_a_changed_call_is_checked_afresh():
    """``check_qed_inputs`` hands calls of equal sizes and options one cached ``QEDProblem``; a
    changed shape, dtype or lambda layout gets its own, and after a good call was cached a bad
    argument (shape, dtype, float64 mixed with float32, device) is still refused by name."""
    from qedprobe.kernels.qed.inputs import check_qed_inputs

    def check(x, initial_state=None):
        return check_qed_inputs("op", *op_args(x), arm="full", z=None, d=None, scale=None,
                                initial_state=initial_state, cu_seqlens=None)

    x = recurrent_inputs(T=1, K=8, V=8)
    first = check(x)
    assert check(recurrent_inputs(T=1, K=8, V=8, seed=5)) is first
    longer = check(recurrent_inputs(T=3, K=8, V=8))
    assert (longer.T, first.T) == (3, 1)
    narrow = check({n: t.float() for n, t in x.items()})
    assert (narrow.compute_dtype, first.compute_dtype) == (torch.float32, F64)
    per_token = check({**x, "lam": x["lam"].expand(2, 1, 2).clone()})
    assert per_token.lam_per_token and not first.lam_per_token
    with pytest.raises(ValueError, match=r"op: `k` must have shape"):
        check({**x, "k": x["k"][:, :, :, :4]})
    with pytest.raises(ValueError, match=r"op: `g` must be float16, bfloat16, float32 or float64"):
        check({**x, "g": x["g"].int()})
    with pytest.raises(ValueError, match=r"op: `q` is torch.float32 but \['k', 'v'"):
        check({**x, "q": x["q"].float()})
    with pytest.raises(ValueError, match=r"op: `b` is on meta but `q` is on cpu"):
        check({**x, "b": x["b"].to("meta")})
    with pytest.raises(ValueError, match=r"op: `initial_state` must have shape"):
        check(x, initial_state=random_state(2, 2, 8, 4, seed=1))
    assert check(x) is first


# --- on a GPU: long sequences, the float32/bf16 path, and fla's kernel ------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; the interpreter tests above cover CPU")
class TestGPU:
    B, T, H, K, V = 2, 4096, 2, 64, 128

    def inputs(self, dtype, seed, T=None):
        x = recurrent_inputs(B=self.B, T=T or self.T, H=self.H, K=self.K, V=self.V, dtype=dtype, seed=seed,
                             device="cuda")
        x["g"] = x["g"].float() * 0.1  # fla and the model pass float32 log-decay
        if dtype == F64:
            x["g"] = x["g"].double()
        return x

    @pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
    @pytest.mark.parametrize("arm", ["full", "rand"])
    def test_long_sequence_against_float64_naive(self, dtype, bound, arm):
        x = self.inputs(dtype, seed=30)
        h0 = random_state(self.B, self.H, self.K, self.V, seed=31, device="cuda", dtype=torch.float32)
        z = z_for(arm, self.H, self.K, device="cuda", dtype=dtype)
        o, s, p = qed_recurrent(*x.values(), arm=arm, z=z, initial_state=h0, output_final_state=True,
                                return_probes=True)
        x64 = {n: t.double() for n, t in x.items()}
        ro, rs, rp = qed_naive(*x64.values(), arm=arm, z=None if z is None else z.double(),
                               initial_state=h0.double(), output_final_state=True, return_probes=True)
        errs = {"o": rel_err(o, ro), "state": rel_err(s, rs), **{n: rel_err(p[n], rp[n]) for n in p}}
        print(f"\nT={self.T} {dtype} {arm} vs float64 qed_naive: {errs}")
        assert errs.pop("o") < bound
        assert max(errs.values()) < 1e-4, errs

    def test_float64_on_gpu(self):
        x = self.inputs(F64, seed=32, T=64)
        x["lam"] = torch.rand(self.B, 64, self.H, dtype=F64, device="cuda")
        got, ref = both(x, arm="nogate", output_final_state=True, return_probes=True)
        assert_outputs_close(got, ref, rtol=1e-10, atol=1e-10)

    def test_decode_steps_equal_one_run(self):
        x = self.inputs(torch.bfloat16, seed=33, T=8)
        o, s, _ = qed_recurrent(*x.values(), output_final_state=True)
        state, outs = None, []
        for t in range(8):
            step = [v[:, t:t + 1] if v.dim() >= 3 else v for v in x.values()]
            o_t, state, _ = qed_recurrent(*step, initial_state=state, output_final_state=True)
            outs.append(o_t)
        torch.testing.assert_close(torch.cat(outs, 1), o)
        torch.testing.assert_close(state, s, rtol=1e-6, atol=1e-6)

    @pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
    @pytest.mark.parametrize("how", ["arm_gdn2", "lam_zero"])
    def test_equals_fla_fused_recurrent_gdn2(self, dtype, bound, how):
        fla = pytest.importorskip("fla.ops.gdn2", reason="fla-core not installed")
        x = self.inputs(dtype, seed=34)
        h0 = random_state(self.B, self.H, self.K, self.V, seed=35, device="cuda", dtype=torch.float32)
        arm, lam = ("gdn2", x["lam"]) if how == "arm_gdn2" else ("full", torch.zeros_like(x["lam"]))
        o, s, _ = qed_recurrent(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], lam, arm=arm,
                                initial_state=h0, output_final_state=True)
        ro, rs = fla.fused_recurrent_gdn2(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], initial_state=h0,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
        errs = {"o": rel_err(o, ro), "state": rel_err(s, rs)}
        print(f"\nT={self.T} {dtype} {how} vs fla fused_recurrent_gdn2: {errs}")
        assert errs["o"] < bound and errs["state"] < 1e-5, errs
