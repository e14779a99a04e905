"""qed_chunk (chunked Triton forward) against the token-loop oracle qed_naive.

CPU: the Triton interpreter (conftest sets TRITON_INTERPRET=1), float64 inputs, tolerance 1e-10,
plus float32 / bfloat16 inputs against the float64 reference with relative bounds.
GPU (skipped without CUDA): T=4096 float32 / bfloat16 against qed_naive in float64 on the GPU,
and arm="gdn2" / lam=0 against fla's chunk_gdn2 (skipped when fla is not importable).
"""
import pytest
import torch
import triton
import triton.language as tl

from qedprobe.kernels.qed import ARMS, qed_naive
from qedprobe.kernels.qed.chunk import qed_chunk
from qedprobe.kernels.qed.chunk_common import exp
from helpers import (DEVICE, OP_INPUTS, PROBES, assert_close, assert_outputs_close, chunk_inputs, expanded_naive, gpu,
                     grouped_inputs, long_check, low_precision, max_diff, op_args, rel_err, z_for)

@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_float64(arm):
    x = chunk_inputs(seed=ARMS.index(arm))
    H, K, V = 2, 16, 32
    z = z_for(arm, H, K, seed=1, device=DEVICE)
    h0 = torch.randn(2, H, K, V, dtype=torch.float64, device=DEVICE)
    kw = dict(arm=arm, z=z, initial_state=h0, output_final_state=True, return_probes=True)
    got = qed_chunk(*op_args(x), **kw)
    ref = qed_naive(*op_args(x), **kw)
    assert_outputs_close(got, ref, atol=1e-10)
    assert got[1].dtype == torch.float64 and got[2]["Sd"].dtype == torch.float64
    if arm != "gdn2":
        assert got[2]["Sd"].abs().max() > 1e-3  # the probe is not trivially zero


@pytest.mark.parametrize("K", [32, 40])
def test_output_kernel_in_key_blocks(monkeypatch, K):
    """The output kernel's loop over the state's rows in key blocks of 16 (two pipeline stages;
    with K=40 the last block is half masked) gives float64 qed_naive's output and Sd probe."""
    from qedprobe.kernels.qed import chunk_scan
    monkeypatch.setattr(chunk_scan, "OUTPUT_KEY_BLOCK", 16)
    monkeypatch.setattr(chunk_scan, "OUTPUT_STAGES", 2)
    x = chunk_inputs(B=2, T=150, H=2, K=K, V=16, seed=26)
    h0 = torch.randn(2, 2, K, 16, dtype=torch.float64, device=DEVICE)
    kw = dict(arm="full", initial_state=h0, output_final_state=True, return_probes=True)
    got = qed_chunk(*op_args(x), **kw)
    assert_outputs_close(got, qed_naive(*op_args(x), **kw), atol=1e-10)
    assert got[2]["Sd"].abs().max() > 1e-3
    monkeypatch.setattr(chunk_scan, "OUTPUT_KEY_BLOCK", 24)
    with pytest.raises(ValueError, match=r"key block \(chunk_scan.OUTPUT_KEY_BLOCK\) must be a power of two"):
        qed_chunk(*op_args(x), **kw)


def test_per_token_lam_and_options():
    x = chunk_inputs(B=1, T=77, K=32, V=16, lam_token=True, seed=3)
    kw = dict(arm="full", scale=0.3, output_final_state=True, return_probes=True)
    assert_outputs_close(qed_chunk(*op_args(x), **kw), qed_naive(*op_args(x), **kw), atol=1e-10)
    kw = dict(arm="nogate", use_qk_l2norm=False, output_final_state=True)
    x["q"], x["k"] = x["q"] * 0.2, x["k"] * 0.2
    assert_outputs_close(qed_chunk(*op_args(x), **kw), qed_naive(*op_args(x), **kw), atol=1e-10)


def test_d_override():
    x = chunk_inputs(seed=4)
    d = torch.randn_like(x["q"]) * 0.5
    kw = dict(arm="full", d=d, output_final_state=True, return_probes=True)
    got = qed_chunk(*op_args(x), **kw)
    assert_outputs_close(got, qed_naive(*op_args(x), **kw), atol=1e-10)
    assert max_diff(got[2]["d"], d) == 0.0


def test_state_carry_two_halves():
    x = chunk_inputs(B=2, T=100, seed=5)
    h0 = torch.randn(2, 2, 16, 32, dtype=torch.float64, device=DEVICE)
    whole = qed_chunk(*op_args(x), initial_state=h0, output_final_state=True, return_probes=True)
    cut = 37
    first = {n: (t[:, :cut] if n != "lam" else t) for n, t in x.items()}
    second = {n: (t[:, cut:] if n != "lam" else t) for n, t in x.items()}
    o1, s1, p1 = qed_chunk(*op_args(first), initial_state=h0, output_final_state=True, return_probes=True)
    o2, s2, p2 = qed_chunk(*op_args(second), initial_state=s1, output_final_state=True, return_probes=True)
    assert max_diff(torch.cat([o1, o2], 1), whole[0]) < 1e-10
    assert max_diff(s2, whole[1]) < 1e-10
    assert max_diff(torch.cat([p1["Sd"], p2["Sd"]], 1), whole[2]["Sd"]) < 1e-10


def test_varlen_chunk_layout_is_built_once_per_packing():
    from qedprobe.kernels.qed.chunk_common import varlen_chunks
    bounds = ((0, 0, 37), (0, 37, 101), (0, 101, 171), (0, 171, 172))  # 1, 1, 2 and 1 chunks of 64
    idx, offs = varlen_chunks(bounds, torch.device("cpu"))
    assert idx.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [3, 0]] and offs.tolist() == [0, 1, 2, 4]
    again = varlen_chunks(tuple(bounds), torch.device("cpu"))  # the next layer of the same pass
    assert again[0] is idx and again[1] is offs


def test_varlen_equals_separate_runs():
    lens = [37, 64, 70, 1]
    T = sum(lens)
    x = chunk_inputs(B=1, T=T, seed=6, lam_token=True)
    cu = torch.tensor([0, 37, 101, 171, 172], dtype=torch.int32, device=DEVICE)
    h0 = torch.randn(len(lens), 2, 16, 32, dtype=torch.float64, device=DEVICE)
    kw = dict(arm="full", output_final_state=True, return_probes=True)
    o, s, p = qed_chunk(*op_args(x), cu_seqlens=cu, initial_state=h0, **kw)
    assert_outputs_close((o, s, p), qed_naive(*op_args(x), cu_seqlens=cu, initial_state=h0, **kw), atol=1e-10)
    for n in range(len(lens)):
        a, e = cu[n].item(), cu[n + 1].item()
        xs = {m: t[:, a:e] for m, t in x.items()}
        on, sn, pn = qed_chunk(*op_args(xs), initial_state=h0[n:n + 1], **kw)
        assert max_diff(on, o[:, a:e]) < 1e-10
        assert max_diff(sn, s[n:n + 1]) < 1e-10
        assert max_diff(pn["Sd"], p["Sd"][:, a:e]) < 1e-10


@pytest.mark.parametrize("gmin,gmax", [(20.0, 0.0), (0.0, 0.0), (20.0, 15.0)])
def test_strong_and_zero_decay(gmin, gmax):
    x = chunk_inputs(B=1, T=90, gmin=gmin, gmax=gmax, seed=7)
    if gmin > 0 and gmax == 0:
        x["g"][..., :4] = 0.0  # some channels never decay, others lose up to 20 nats per token
    h0 = torch.randn(1, 2, 16, 32, dtype=torch.float64, device=DEVICE)
    kw = dict(arm="full", initial_state=h0, output_final_state=True, return_probes=True)
    got = qed_chunk(*op_args(x), **kw)
    assert all(torch.isfinite(t).all() for t in (got[0], got[1], *got[2].values()))
    assert_outputs_close(got, qed_naive(*op_args(x), **kw), atol=1e-10)


@pytest.mark.parametrize("K,V,T", [(20, 24, 33), (64, 16, 65), (256, 16, 70)])
def test_odd_sizes(K, V, T):
    x = chunk_inputs(B=1, T=T, K=K, V=V, seed=8)
    kw = dict(arm="noproj", output_final_state=True, return_probes=True)
    assert_outputs_close(qed_chunk(*op_args(x), **kw), qed_naive(*op_args(x), **kw), atol=1e-10)


def test_probes_off_same_output():
    x = chunk_inputs(B=1, T=70, seed=9)
    o, s, p = qed_chunk(*op_args(x), arm="full")
    assert s is None and p is None
    o2, _, p2 = qed_chunk(*op_args(x), arm="full", return_probes=True)
    assert max_diff(o, o2) == 0.0 and p2 is not None


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 5e-3), (torch.bfloat16, 2e-2)])
def test_low_precision_vs_float64(dtype, bound):
    x, ref_in = low_precision(chunk_inputs(B=1, T=100, seed=10), dtype)  # ref_in: same values, float64
    h0 = torch.randn(1, 2, 16, 32, device=DEVICE)
    kw = dict(arm="full", output_final_state=True, return_probes=True)
    o, s, p = qed_chunk(*op_args(x), initial_state=h0, **kw)
    o2, s2, p2 = qed_naive(*op_args(ref_in), initial_state=h0.double(), **kw)
    assert o.dtype == dtype and s.dtype == torch.float32 and p["Sd"].dtype == torch.float32
    assert_close("o", o, o2, bound)
    assert_close("state", s, s2, bound)
    for n in PROBES:
        assert_close(n, p[n], p2[n], bound)


@pytest.mark.parametrize("arm,varlen", [("full", False), ("rand", True)])
def test_grouped_value_heads(arm, varlen):
    """HV = 2 H value heads (head j reads q/k head j // 2) against qed_naive on expanded q, k:
    output, state, every probe; per-token lam and packed sequences in the second case."""
    x = grouped_inputs(B=1, T=70, H=2, HV=4, K=16, V=16, seed=12, lam_token=varlen, device=DEVICE)
    cu = torch.tensor([0, 23, 70], dtype=torch.int32, device=DEVICE) if varlen else None
    h0 = torch.randn(2 if varlen else 1, 4, 16, 16, dtype=torch.float64, device=DEVICE)
    kw = dict(arm=arm, z=z_for(arm, 4, 16, device=DEVICE), initial_state=h0, cu_seqlens=cu,
              output_final_state=True, return_probes=True)
    got = qed_chunk(*op_args(x), **kw)
    assert_outputs_close(got, expanded_naive(x, **kw), atol=1e-10)
    assert got[2]["rho"].shape == (1, 70, 4)


def test_grouped_heads_refused_unless_a_multiple():
    x = grouped_inputs(B=1, T=8, H=2, HV=3, K=16, V=16, seed=13, device=DEVICE)
    with pytest.raises(ValueError, match=r"`v` \(HV=3\) must be a multiple"):
        qed_chunk(*op_args(x))


def test_no_kernel_is_autotuned():
    """Every launch configuration is chosen by rule, so a call's time cannot depend on the shapes
    called before it: no kernel of qed_chunk / qed_recurrent sits under a triton.autotune."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    from qedprobe.kernels.qed import (chunk_bwd_intra, chunk_bwd_prep, chunk_bwd_scan, chunk_intra, chunk_scan,
                                      chunk_wy, fused_recurrent)
    kernels = set()
    for mod in (chunk_intra, chunk_wy, chunk_scan, chunk_bwd_intra, chunk_bwd_scan, chunk_bwd_prep, fused_recurrent):
        for obj in vars(mod).values():
            while isinstance(obj, (Autotuner, Heuristics)):
                assert not isinstance(obj, Autotuner), f"{mod.__name__}: an autotuned kernel"
                obj = obj.fn
            name = getattr(getattr(obj, "fn", None), "__name__", "")
            if name.endswith("_kernel"):
                kernels.add(name)
    assert {"qed_prep_kernel", "qed_scores_kernel", "qed_inverse_kernel", "qed_wy_kernel", "qed_state_kernel",
            "qed_output_kernel",
            "qed_recurrent_kernel", "qed_dstate_kernel", "qed_bwd_wy_kernel", "qed_bwd_scores_kernel",
            "qed_bwd_dg_kernel", "qed_prep_bwd_kernel"} <= kernels


def test_prep_register_cap_only_without_probes_and_hats():
    """The prep's register cap applies to the forward without probes; with probes or the backward's
    outputs the launch leaves registers to ptxas."""
    from qedprobe.kernels.qed import chunk_intra
    assert chunk_intra.prep_maxnreg(False, False) == chunk_intra.PREP_MAXNREG == 168
    assert chunk_intra.prep_maxnreg(True, False) is None
    assert chunk_intra.prep_maxnreg(False, True) is None


def test_state_scan_value_block_rule():
    """The pipelined (bf16) state scan takes value blocks of 32 when twice its programs still fit in
    one wave of the GPU's SMs (few, long sequences), else 64; float32 tiles and unknown GPUs keep
    their one configuration."""
    from qedprobe.kernels.qed.chunk_scan import state_config
    bf16 = torch.bfloat16
    assert state_config(128, 128, bf16, scans=8 * 16, sm_count=132) == (64, 4, 2)  # 512 programs at 32
    assert state_config(128, 128, bf16, scans=4 * 16, sm_count=132) == (32, 4, 2)  # 256 <= 2 x 132
    assert state_config(128, 128, bf16, scans=66, sm_count=132) == (32, 4, 2)      # 264: the last that fits
    assert state_config(128, 128, bf16, scans=67, sm_count=132) == (64, 4, 2)
    assert state_config(128, 128, bf16) == (64, 4, 2)
    assert state_config(128, 128, torch.float32, scans=2, sm_count=132) == (64, 8, 1)
    assert state_config(256, 128, bf16, scans=2, sm_count=132) == (32, 8, 1)  # K=256: never pipelined


def test_row_decay_state_scan_rule():
    """The scalar-gate scan takes the smallest value block whose programs fit one per SM (four stages
    at 16, three above), value blocks of 64 three deep up to two waves, and falls back to the
    per-channel rule beyond."""
    from qedprobe.kernels.qed.chunk_scan import state_config
    bf16 = torch.bfloat16
    rule = lambda scans: state_config(128, 128, bf16, scans=scans, sm_count=132, row_decay=True)  # noqa: E731
    assert rule(8) == (16, 4, 4)        # 64 programs at 16
    assert rule(16) == (16, 4, 4)       # 1 x 16 value heads: 128 programs at 16
    assert rule(17) == (32, 4, 3)       # 136 at 16, 68 at 32
    assert rule(33) == (32, 4, 3)       # 132 programs: the last that fits at 32
    assert rule(34) == (64, 4, 3)       # 136 at 32, 68 at 64
    assert rule(64) == (64, 4, 3)       # 1 x 64 value heads: 128 programs at 64
    assert rule(66) == (64, 4, 3)
    assert rule(8 * 16) == (64, 4, 3)   # 8 x 16 value heads: 256 programs at 64, two waves
    assert rule(132) == (64, 4, 3)      # 264: the last two waves
    assert rule(133) == (64, 4, 2)      # 266 at 64: two deep, as the per-channel rule
    assert rule(8 * 32) == (64, 4, 2)
    assert state_config(128, 128, bf16, row_decay=True) == (64, 4, 2)  # GPU unknown
    assert state_config(128, 128, torch.float32, scans=2, sm_count=132, row_decay=True) == (64, 8, 1)


def test_output_formed_in_the_scan_where_it_runs_value_blocks_of_64_three_deep():
    """``scan_forms_output``: only where the scalar-gate scan runs value blocks of 64 three deep
    (Qwen3.5-0.8B's 16 value heads at 8 x 4K, 64 at 1 x 32K), not at 16 or 32, not two deep, not in
    float32 and not where the GPU is unknown (the interpreter)."""
    from qedprobe.kernels.qed.chunk_scan import scan_forms_output
    forms = lambda scans, dtype=torch.bfloat16, sms=132: scan_forms_output(128, 128, dtype, scans=scans,  # noqa: E731
                                                                             sm_count=sms)
    assert forms(8 * 16) and forms(64) and forms(132)
    assert not forms(16) and not forms(32) and not forms(133) and not forms(8 * 32)
    assert not forms(8 * 16, torch.float32) and not forms(8 * 16, sms=None)


def test_block_inverse_writes_zeros_above_the_diagonal(monkeypatch):
    """``chunk_inverse_fwd`` against ``torch.linalg.inv(I + A)`` per chunk and value head in float64,
    the partial last chunk of T = 100 included, with exact zeros above the diagonal (W/U and the
    backward load ``Ai``'s rows whole). Its output starts as NaN, so an entry left unwritten shows."""
    from qedprobe.kernels.qed.chunk import chunk_precision
    from qedprobe.kernels.qed.chunk_common import BT, chunk_layout
    from qedprobe.kernels.qed.chunk_wy import chunk_inverse_fwd
    from qedprobe.kernels.qed.inputs import check_qed_inputs
    x = chunk_inputs(B=2, seed=5)
    q, k, v, g, b, w, lam = op_args(x)
    P = check_qed_inputs("qed_chunk", q, k, v, g, b, w, lam, arm="full", z=None, d=None, scale=None,
                         initial_state=None, cu_seqlens=None)
    lay = chunk_layout(P, None, q.device, chunk_precision(P, q, k, v, b, w)[1])
    B, T, HV = v.shape[:3]
    gen = torch.Generator().manual_seed(0)
    akk = torch.zeros(B, T, HV, BT, dtype=torch.float64)
    for c0 in range(0, T, BT):
        n = min(BT, T - c0)
        a = torch.randn(B, n, HV, n, generator=gen, dtype=torch.float64) * 0.3
        akk[:, c0:c0 + n, :, :n] = a * torch.ones(n, n).tril(-1)[None, :, None, :].to(a)
    nan_like = lambda t, **kw: torch.full_like(t, float("nan"), **kw)  # noqa: E731
    monkeypatch.setattr(torch, "empty_like", nan_like)
    ai = chunk_inverse_fwd(akk.to(DEVICE), lay=lay, out_dtype=torch.float64).cpu()
    for c0 in range(0, T, BT):
        n = min(BT, T - c0)
        A = akk[:, c0:c0 + n, :, :n].permute(0, 2, 1, 3)
        want = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + A)
        got = ai[:, c0:c0 + n].permute(0, 2, 1, 3)
        assert_close("Ai", got[..., :n], want, 1e-12)
        assert (got[..., n:] == 0).all() and (got[..., :n].triu(1) == 0).all()


def test_block_inverse_of_float16_scores():
    """The scalar-gate path stores its erase scores as float16 where its intermediates are bf16
    (``scalar_gram.scores_dtype``): the block inverse reads them as such and inverts the rounded
    scores to float32 accuracy, and on scores shaped as the op's (``b (k_hat_t . k_hat_j)
    e^{G_t - G_j}``, ``j < t``, keys normalised and correlated) the rounding moves ``(I + A)^{-1}``
    less than the bf16 rounding its result is stored with on that path."""
    from qedprobe.kernels.qed.chunk_common import BT, chunk_layout
    from qedprobe.kernels.qed.chunk_wy import chunk_inverse_fwd
    from qedprobe.kernels.qed.inputs import check_qed_inputs
    from qedprobe.kernels.qed.scalar_gram import scores_dtype
    assert scores_dtype(torch.bfloat16, torch.float32) == torch.float16
    assert scores_dtype(torch.float32, torch.float32) == torch.float32
    assert scores_dtype(torch.float64, torch.float64) == torch.float64
    x = chunk_inputs(B=1, T=2 * BT, seed=6)
    q, k, v, g, b, w, lam = op_args(x)
    P = check_qed_inputs("qed_chunk", q, k, v, g, b, w, lam, arm="full", z=None, d=None, scale=None,
                         initial_state=None, cu_seqlens=None)
    lay = chunk_layout(P, None, q.device, "tf32")
    B, T, HV = v.shape[:3]
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(B, T, HV, 128, generator=gen, dtype=torch.float64) + 2 * torch.randn(128, generator=gen,
                                                                                          dtype=torch.float64)
    keys = torch.nn.functional.normalize(keys, dim=-1)
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    G = torch.cumsum(-0.1 * torch.rand(B, T, HV, generator=gen, dtype=torch.float64), 1)
    akk = torch.zeros(B, T, HV, BT, dtype=torch.float64)
    for c0 in range(0, T, BT):
        kc, Gc = keys[:, c0:c0 + BT].transpose(1, 2), G[:, c0:c0 + BT].transpose(1, 2)  # [B, HV, BT, ...]
        scores = beta[:, c0:c0 + BT].transpose(1, 2)[..., None] * (kc @ kc.transpose(-1, -2))
        scores = scores * (Gc[..., :, None] - Gc[..., None, :]).clamp(max=0).exp() * torch.ones(BT, BT).tril(-1).double()
        akk[:, c0:c0 + BT] = scores.transpose(1, 2)
    a16 = akk.to(torch.float16)
    ai = chunk_inverse_fwd(a16.to(DEVICE), lay=lay, out_dtype=torch.float32).cpu().double()
    for c0 in range(0, T, BT):
        inv = lambda A: torch.linalg.inv(torch.eye(BT, dtype=torch.float64) + A[:, c0:c0 + BT].transpose(1, 2))  # noqa: E731
        got, exact = ai[:, c0:c0 + BT].transpose(1, 2), inv(akk)
        assert_close("Ai of the float16 scores", got, inv(a16.double()), 1e-5)
        assert rel_err(got, exact) < rel_err(exact.bfloat16().double(), exact)


def test_rejects_bad_input():
    x = chunk_inputs(B=1, T=8, seed=11)
    with pytest.raises(ValueError):
        qed_chunk(*op_args(x), arm="rand")  # z missing
    with pytest.raises(ValueError):
        qed_chunk(*op_args(x), arm="bogus")


# ----------------------------------------------------------------------------------------- GPU
@long_check([(torch.float32, 5e-3), (torch.bfloat16, 2e-2)])
def test_gpu_long_vs_naive(dtype, bound, arm):
    B, T, H, K, V = 1, 4096, 2, 128, 128
    x64 = chunk_inputs(B=B, T=T, H=H, K=K, V=V, gmin=0.1, seed=20, device="cuda")
    x, ref_in = low_precision(x64, dtype)
    h0 = torch.randn(B, H, K, V, device="cuda")
    kw = dict(arm=arm, output_final_state=True, return_probes=True)
    o, s, p = qed_chunk(*op_args(x), initial_state=h0, **kw)
    o2, s2, p2 = qed_naive(*op_args(ref_in), initial_state=h0.double(), **kw)
    errs = {n: rel_err(p[n], p2[n]) for n in PROBES}
    print(f"T={T} {dtype} {arm}: rel err o {rel_err(o, o2):.2e}, state {rel_err(s, s2):.2e}, probes {errs}")
    assert_close("o", o, o2, bound)
    assert_close("state", s, s2, bound)
    for n in PROBES:
        assert_close(n, p[n], p2[n], bound)


@gpu
def test_gpu_state_scan_value_blocks_agree(monkeypatch):
    """bf16 at B=1, H=2 (two scans): the rule's value blocks of 32 and the wide rule's 64 (forced by
    counting no program slots) both match float64 qed_naive and each other."""
    from qedprobe.kernels.qed import chunk_scan
    x64 = chunk_inputs(B=1, T=4096, H=2, K=128, V=128, gmin=0.1, seed=25, device="cuda")
    x, ref_in = low_precision(x64, torch.bfloat16)
    kw = dict(arm="full", output_final_state=True, return_probes=True)
    ref = qed_naive(*op_args(ref_in), **kw)
    runs, narrow = {}, chunk_scan.STATE_PROGRAMS_PER_SM
    sms = chunk_scan.multiprocessors(torch.device("cuda"))
    for slots in (narrow, 0):
        monkeypatch.setattr(chunk_scan, "STATE_PROGRAMS_PER_SM", slots)
        assert chunk_scan.state_config(128, 128, torch.bfloat16, scans=2, sm_count=sms)[0] == (32 if slots else 64)
        o, s, p = runs[slots] = qed_chunk(*op_args(x), **kw)
        assert_close("o", o, ref[0], 2e-2)
        assert_close("state", s, ref[1], 2e-2)
        for n in PROBES:
            assert_close(n, p[n], ref[2][n], 2e-2)
    (o64, s64, p64), (o32, s32, p32) = runs[0], runs[narrow]
    assert_close("o (BV 32 vs 64)", o32, o64, 1e-3)
    assert_close("state (BV 32 vs 64)", s32, s64, 1e-3)
    for n in PROBES:
        assert_close(f"{n} (BV 32 vs 64)", p32[n], p64[n], 1e-3)


@triton.jit
def _apply_exp(x, y, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, exp(tl.load(x + o)))


@gpu
def test_gpu_exp_is_torch_exp_but_for_subnormal_results():
    """chunk_common.exp on the GPU: float32 within 2^-21 + |x| 2^-23 of torch.exp in float64 (the
    rounding of x log2(e) grows with |x|) wherever e^x is a normal float32 (-87.3 <= x <= 88.7),
    exactly 0 below (where tl.exp gives subnormals) and inf above; float64 through tl.exp."""
    for dtype, eps in ((torch.float32, 2.0 ** -23), (torch.float64, 2.0 ** -50)):
        x = torch.cat([torch.linspace(-87.3, 88.7, 4000, dtype=torch.float64),
                       torch.tensor([-88.0, -100.0, -1e4, float("-inf"), 89.0, 0.0], dtype=torch.float64)])
        x = torch.nn.functional.pad(x, (0, 4096 - len(x))).to(dtype).cuda()
        y = torch.empty_like(x)
        _apply_exp[(1,)](x, y, N=4096)
        xd = x.double()
        ref = torch.exp(xd)
        normal = (xd >= -87.3) & (xd <= 88.7)
        err = (y.double() - ref).abs() / ref
        assert (err[normal] <= 4 * eps + xd[normal].abs() * eps).all()
        if dtype == torch.float32:
            assert (y[x < -87.4] == 0).all() and torch.isinf(y[x > 88.8]).all()


@gpu
def test_gpu_float64_and_varlen():
    x = chunk_inputs(B=1, T=1000, H=2, K=128, V=64, gmin=3.0, seed=21, device="cuda")
    cu = torch.tensor([0, 100, 433, 1000], dtype=torch.int32, device="cuda")
    kw = dict(arm="full", cu_seqlens=cu, output_final_state=True, return_probes=True)
    assert_outputs_close(qed_chunk(*op_args(x), **kw), qed_naive(*op_args(x), **kw), atol=1e-9)


@gpu
def test_gpu_vs_fla_gdn2():
    """arm="gdn2", and arm="full" with lam = 0, equal fla's chunk_gdn2 (bf16, the benchmark's H, K, V)."""
    fla = pytest.importorskip("fla.ops.gdn2")
    B, T, H, K, V = 2, 4096, 16, 128, 128
    x = chunk_inputs(B=B, T=T, H=H, K=K, V=V, gmin=0.1, seed=22, device="cuda", dtype=torch.bfloat16)
    x["g"] = x["g"].float()
    h0 = torch.randn(B, H, K, V, device="cuda")
    o_f, s_f = fla.chunk_gdn2(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], initial_state=h0,
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    for arm, lam in (("gdn2", x["lam"]), ("full", torch.zeros_like(x["lam"]))):
        o, s, _ = qed_chunk(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], lam, arm=arm,
                            initial_state=h0, output_final_state=True)
        print(f"vs fla chunk_gdn2 ({arm}): rel err o {rel_err(o, o_f):.2e}, state {rel_err(s, s_f):.2e}")
        assert_close(f"o ({arm})", o, o_f, 2e-2)
        assert_close(f"state ({arm})", s, s_f, 2e-2)


@gpu
def test_gpu_grouped_value_heads_vs_expanded():
    """Qwen3.5-style heads (H=16 q/k heads, HV=32 value heads), bf16: the grouped call equals the
    call with q, k expanded to 32 heads (the same kernels on the same values)."""
    x = {n: t.to(torch.bfloat16) for n, t in grouped_inputs(B=1, T=2048, H=16, HV=32, K=128, V=128, seed=24,
                                                            device="cuda").items()}
    x["g"] = x["g"].float()
    o, s, p = qed_chunk(*op_args(x), output_final_state=True, return_probes=True)
    qe, ke = (x[n].repeat_interleave(2, dim=2) for n in ("q", "k"))
    o2, s2, p2 = qed_chunk(qe, ke, *(x[n] for n in OP_INPUTS[2:]), output_final_state=True, return_probes=True)
    assert_close("o", o, o2, 1e-3)
    assert_close("final state", s, s2, 1e-3)
    for n in PROBES:
        assert_close(n, p[n], p2[n], 1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_second_device_gives_the_same_results():
    """Inputs on cuda:1 with cuda:0 current: the kernels must run on cuda:1 (forward and backward)."""
    from qedprobe.kernels.qed.fused_recurrent import qed_recurrent

    x0 = chunk_inputs(B=2, T=300, H=2, K=64, V=64, seed=23, device="cuda:0", dtype=torch.float32)
    x1 = {n: t.to("cuda:1") for n, t in x0.items()}
    for op in (qed_chunk, qed_recurrent):
        o0 = op(*x0.values())[0]
        o1 = op(*x1.values())[0]
        assert o1.device == torch.device("cuda:1")
        assert torch.equal(o0.cpu(), o1.cpu()), op.__name__
    grads = []
    for x in (x0, x1):
        q = x["q"].clone().requires_grad_()
        o = qed_chunk(q, *list(x.values())[1:])[0]
        grads.append(torch.autograd.grad(o.square().sum(), q)[0].cpu())
    assert torch.equal(*grads)
