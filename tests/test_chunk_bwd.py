"""Backward of qed_chunk (Triton) against autograd through the token-loop oracle qed_naive.

CPU: the Triton interpreter (conftest sets TRITON_INTERPRET=1), float64 inputs, gradients of
``sum(o * do) + sum(final_state * dht)`` w.r.t. q, k, v, g, b, w, lam, (d) and the initial state
within 1e-9 of the oracle's; T not a multiple of 64, varlen, per-token lam, strong decay.
GPU (skipped without CUDA): T=2048 float32 / bfloat16 against the float64 oracle on the GPU
(relative errors), and arm="gdn2" against fla chunk_gdn2's backward (skipped without fla).
"""
import pytest
import torch

from qedprobe.kernels.qed import ARMS, qed_naive
from qedprobe.kernels.qed.chunk import qed_chunk
from helpers import (DEVICE, OP_INPUTS, assert_close, chunk_inputs, expanded_naive, gpu, grouped_inputs, long_check,
                     low_precision, max_diff, op_args, rel_err, z_for)

def grads(op, x, kw, h0=None, extra=(), seed=5, use_o=True, use_state=True):
    """Gradients of ``<o, do> + <final_state, dht>`` w.r.t. ``x``'s tensors, ``extra``, ``h0``."""
    leaves = [x[n].detach().requires_grad_(True) for n in OP_INPUTS]
    extra = [t.detach().requires_grad_(True) for t in extra]
    h0 = h0.detach().requires_grad_(True) if h0 is not None else None
    if extra:
        kw = dict(kw, d=extra[0])
    o, s, p = op(*leaves, initial_state=h0, output_final_state=use_state, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = 0.
    if use_o:
        loss = loss + (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
    if use_state:
        loss = loss + (s.double() * torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.device)).sum()
    wrt = leaves + extra + ([h0] if h0 is not None else [])
    return torch.autograd.grad(loss, wrt, allow_unused=True), p


def assert_grads(x, kw, tol=1e-9, **opts):
    got, _ = grads(qed_chunk, x, kw, **opts)
    ref, _ = grads(qed_naive, x, kw, **opts)
    names = list(OP_INPUTS) + ["d"] * len(opts.get("extra", ())) + ["h0"] * (opts.get("h0") is not None)
    for n, a, b in zip(names, got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, n
        assert max_diff(a, b) < tol * max(1., b.abs().max().item()), (n, max_diff(a, b))


def state(x, N, seed=3):
    H, K, V = x["q"].shape[2], x["q"].shape[3], x["v"].shape[3]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(N, H, K, V, generator=gen, dtype=torch.float64).to(device=x["q"].device, dtype=torch.float64)


@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_float64(arm):
    x = chunk_inputs(B=2, T=70, H=1, K=16, V=16, seed=30 + ARMS.index(arm))
    kw = dict(arm=arm, z=z_for(arm, 1, 16, seed=1, device=DEVICE))
    assert_grads(x, kw, h0=state(x, 2))


def test_per_token_lam_no_l2norm_and_d_override():
    x = chunk_inputs(B=1, T=70, H=2, K=16, V=16, seed=40, lam_token=True)
    assert_grads(x, dict(arm="full", use_qk_l2norm=False, scale=0.3), h0=state(x, 1))
    d = chunk_inputs(B=1, T=70, H=2, K=16, V=16, seed=41)["q"] * 0.3
    assert_grads(x, dict(arm="full"), extra=(d,))


def test_varlen():
    x = chunk_inputs(B=1, T=130, H=1, K=16, V=16, seed=42, gmin=1.0)
    cu = torch.tensor([0, 30, 97, 130], dtype=torch.int32, device=DEVICE)
    assert_grads(x, dict(arm="full", cu_seqlens=cu), h0=state(x, 3))


def test_varlen_several_heads_and_key_slices():
    """Packed sequences with two heads and K = 80: several key slices of the scores and dg kernels
    (the last partly masked), row blocks past a sequence's end, per-head offsets with varlen."""
    x = chunk_inputs(B=1, T=130, H=2, K=80, V=16, seed=49, gmin=1.0)
    cu = torch.tensor([0, 30, 97, 130], dtype=torch.int32, device=DEVICE)
    assert_grads(x, dict(arm="full", cu_seqlens=cu), h0=state(x, 3))


def test_several_key_and_value_slices():
    """K, V beyond one 32-channel slice (and not powers of two): per-slice loops and the
    per-value-block partial sums."""
    x = chunk_inputs(B=1, T=70, H=1, K=48, V=40, seed=47)
    assert_grads(x, dict(arm="full"), h0=state(x, 1))


@pytest.mark.parametrize("gmin,gmax", [(40.0, 5.0), (0.0, 0.0)])
def test_strong_and_zero_decay(gmin, gmax):
    x = chunk_inputs(B=1, T=70, H=1, K=16, V=16, seed=43, gmin=gmin, gmax=gmax)
    assert_grads(x, dict(arm="noproj"), h0=state(x, 1))


def test_only_output_or_only_state_gradient():
    x = chunk_inputs(B=1, T=70, H=1, K=16, V=16, seed=44)
    assert_grads(x, dict(arm="full"), use_state=False)
    assert_grads(x, dict(arm="full"), h0=state(x, 1), use_o=False)


@pytest.mark.parametrize("arm,lam_token,d_given", [("full", True, False), ("rand", False, False),
                                                    ("nogate", True, True)])
def test_grouped_value_heads(arm, lam_token, d_given):
    """HV = 2 H: gradients (q, k summed over their group of value heads) against autograd through
    qed_naive on expanded q, k; per-token or per-head lam, the rand arm's per-value-head z, a
    given d, initial and final state."""
    x = grouped_inputs(B=1, T=70, H=2, HV=4, K=16, V=16, seed=48, lam_token=lam_token, device=DEVICE)
    h0 = torch.randn(1, 4, 16, 16, dtype=torch.float64, device=DEVICE)
    kw = dict(arm=arm, z=z_for(arm, 4, 16, device=DEVICE))
    extra = (0.3 * torch.randn(1, 70, 4, 16, dtype=torch.float64, device=DEVICE),) if d_given else ()
    got, _ = grads(qed_chunk, x, kw, h0=h0, extra=extra)
    ref, _ = grads(lambda *a, **kw: expanded_naive(dict(zip(OP_INPUTS, a)), **kw), x, kw, h0=h0, extra=extra)
    names = (*OP_INPUTS, *(("d",) if d_given else ()), "h0")
    for n, a, b in zip(names, got, ref):
        assert a.shape == b.shape, n
        assert max_diff(a, b) < 1e-9 * max(1., b.abs().max().item()), (n, max_diff(a, b))
    assert got[0].shape == (1, 70, 2, 16)


def test_probes_are_not_differentiable():
    x = chunk_inputs(B=1, T=20, H=1, K=16, V=16, seed=45)
    _, p = grads(qed_chunk, x, dict(arm="full", return_probes=True))
    assert all(not t.requires_grad for t in p.values())
    leaves = {n: t.requires_grad_(True) for n, t in x.items()}
    with torch.no_grad():
        o, _, _ = qed_chunk(*op_args(leaves))
    assert o.grad_fn is None


def test_no_launch_reads_what_was_not_written(monkeypatch):
    """Every buffer the forward and backward allocate starts as NaN (torch.empty is uninitialised
    on a GPU): the results still match, so no kernel reads an element no launch wrote (the score
    matrices and the block inverse are written only on and below the diagonal)."""
    def nan_filled(alloc):
        def make(*a, **kw):
            t = alloc(*a, **kw)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return make
    monkeypatch.setattr(torch, "empty", nan_filled(torch.empty))
    monkeypatch.setattr(torch, "empty_like", nan_filled(torch.empty_like))
    x = chunk_inputs(B=1, seed=6)
    kw = dict(arm="full", return_probes=True)
    o, _, probes = qed_chunk(*op_args(x), **kw)
    ref_o, _, ref_probes = qed_naive(*op_args(x), **kw)
    assert max_diff(o, ref_o) < 1e-10 and max_diff(probes["Sd"], ref_probes["Sd"]) < 1e-10
    assert_grads(x, dict(arm="full"), use_state=False)


def test_float32_vs_float64():
    x64 = chunk_inputs(B=1, T=70, H=1, K=16, V=16, seed=46)
    x32 = {n: t.float() for n, t in x64.items()}
    got, _ = grads(qed_chunk, x32, dict(arm="full"), use_state=False)
    ref, _ = grads(qed_naive, x64, dict(arm="full"), use_state=False)
    for n, a, b in zip(OP_INPUTS, got, ref):
        assert a.dtype == torch.float32
        assert_close(f"d{n}", a, b, 1e-4)


# ----------------------------------------------------------------------------------------- GPU
@long_check([(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_gpu_long_vs_naive(dtype, bound, arm):
    B, T, H, K, V = 1, 2048, 2, 128, 128
    x64 = chunk_inputs(B=B, T=T, H=H, K=K, V=V, gmin=0.1, seed=50, device="cuda")
    x, ref_in = low_precision(x64, dtype)
    h0 = state(x64, B).float()
    got, _ = grads(qed_chunk, x, dict(arm=arm), h0=h0)
    ref, _ = grads(qed_naive, ref_in, dict(arm=arm), h0=h0.double())
    errs = {n: rel_err(a, b) for n, a, b in zip(OP_INPUTS + ("h0",), got, ref)}
    print(f"T={T} {dtype} {arm}: grad rel errs {errs}")
    assert all(e < bound for e in errs.values()), errs


@gpu
def test_gpu_float64_varlen():
    x = chunk_inputs(B=1, T=1000, H=2, K=64, V=64, gmin=3.0, seed=51, device="cuda")
    cu = torch.tensor([0, 100, 433, 1000], dtype=torch.int32, device="cuda")
    assert_grads(x, dict(arm="full", cu_seqlens=cu), h0=state(x, 3))


@gpu
def test_gpu_vs_fla_gdn2_backward():
    """arm="gdn2", and arm="full" with lam = 0: gradients equal those of fla's chunk_gdn2 (bf16,
    K=V=128; lam's own gradient is not compared)."""
    fla = pytest.importorskip("fla.ops.gdn2")
    B, T, H, K, V = 2, 2048, 4, 128, 128
    x = chunk_inputs(B=B, T=T, H=H, K=K, V=V, gmin=0.1, seed=52, device="cuda", dtype=torch.bfloat16)
    x["g"] = x["g"].float()
    h0 = state(x, B).float()

    def fla_op(q, k, v, g, b, w, lam, *, initial_state, output_final_state, arm):
        o, s = fla.chunk_gdn2(q, k, v, g, b, w, initial_state=initial_state, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
        return o, s, None  # lam unused: GDN-2 has no QED term

    ref, _ = grads(fla_op, x, dict(arm="gdn2"), h0=h0)
    for arm, lam in (("gdn2", x["lam"]), ("full", torch.zeros_like(x["lam"]))):
        got, _ = grads(qed_chunk, dict(x, lam=lam), dict(arm=arm), h0=h0)
        for n, a, b in zip(OP_INPUTS + ("h0",), got, ref):
            if n == "lam":
                continue
            print(f"vs fla chunk_gdn2 backward ({arm}): d{n} rel err {rel_err(a, b):.2e}")
            assert_close(f"d{n} ({arm})", a, b, 3e-2)
