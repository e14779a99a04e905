"""Per-head gates: ``g, b, w`` as ``[B, T, HV]`` (Gated DeltaNet's decay and ``beta``) and KDA's
per-channel ``g`` with per-head ``b, w``, in every op.

CPU (the Triton kernels in the interpreter): float64 against ``qed_naive`` fed the same gates
broadcast to their per-channel shapes, and against ``qed_naive`` with per-head gates itself;
every arm, per-token lambda, grouped value heads, packed sequences, initial and final states,
every probe; the explicit per-channel fallback of a differentiable ``qed_chunk`` call.
GPU (skipped without CUDA): against fla's ``chunk_gated_delta_rule`` / ``chunk_kda`` at
lambda 0 and against ``qed_naive`` at T = 4096.
"""
import types

import pytest
import torch

from qedprobe.kernels.qed import ARMS, qed_chunk, qed_chunk_torch, qed_naive, qed_recurrent
from qedprobe.kernels.qed import chunk as chunk_mod
from qedprobe.kernels.qed import chunk_common, chunk_scan, scalar_gram
from helpers import DEVICE, assert_close, assert_outputs_close, gpu, grouped_inputs, rel_err, z_for

F64 = torch.float64
B, T, H, HV, K, V = 1, 70, 2, 4, 16, 8
FORMS = ("gdn", "kda")
"""``gdn``: g, b, w all ``[B, T, HV]``; ``kda``: g per channel, b and w ``[B, T, HV]``."""


def head_case(form, seed, device=DEVICE):
    """Inputs with per-head gates in ``form``, and the same gates broadcast per channel: ``(x, wide)``."""
    x = grouped_inputs(B=B, T=T, H=H, HV=HV, K=K, V=V, seed=seed, lam_token=seed % 2 == 0, device=device)
    x["b"], x["w"] = x["b"][..., 0], x["w"][..., 0]
    if form == "gdn":
        x["g"] = x["g"][..., 0]
    wide = dict(x, g=x["g"] if form == "kda" else x["g"][..., None].expand(B, T, HV, K),
                b=x["b"][..., None].expand(B, T, HV, K), w=x["w"][..., None].expand(B, T, HV, V))
    return x, wide


def args(x):
    return tuple(x[n] for n in ("q", "k", "v", "g", "b", "w", "lam"))


def options(arm, seed, device=DEVICE):
    """Every option at once: packed sequences, initial and final states, probes."""
    return dict(arm=arm, z=z_for(arm, HV, K, device=device), cu_seqlens=torch.tensor([0, 23, 70], device=device),
                initial_state=torch.randn(2, HV, K, V, dtype=F64, generator=torch.Generator().manual_seed(seed)).to(device),
                output_final_state=True, return_probes=True)


def recorded_grams(monkeypatch) -> list:
    """The ``(gram, akk)`` of each Gram stage ``qed_chunk`` launches from here on, in order."""
    made = []

    def kept(*a, gram_fwd=scalar_gram.scalar_gram_fwd, **k):
        made.append(gram_fwd(*a, **k))
        return made[-1]
    monkeypatch.setattr(chunk_mod, "scalar_gram_fwd", kept)
    return made


def recorded_scans(monkeypatch) -> list:
    """For each state scan ``qed_chunk`` launches from here on, in order: ``(o, hs)``, whether it
    forms the output itself and whether it stores the chunk-start states."""
    scans = []

    def spy(*a, scan=chunk_mod.chunk_state_fwd, **kw):
        scans.append((kw.get("o") is not None, kw["hs"] is not None))
        return scan(*a, **kw)
    monkeypatch.setattr(chunk_mod, "chunk_state_fwd", spy)
    return scans


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("arm", ARMS)
def test_pytorch_ops(arm, form):
    seed = ARMS.index(arm) + 7 * FORMS.index(form)
    x, wide = head_case(form, seed, device="cpu")
    kw = options(arm, seed, device="cpu")
    ref = qed_naive(*args(wide), **kw)
    assert_outputs_close(qed_naive(*args(x), **kw), ref, atol=1e-12)
    assert_outputs_close(qed_chunk_torch(*args(x), **kw), ref, atol=1e-10)
    if arm != "gdn2":
        assert ref[2]["Sd"].abs().max() > 1e-3


@pytest.mark.parametrize("arm", ARMS)
def test_triton_ops(arm):
    """qed_chunk and qed_recurrent (one form per arm, alternating) read the per-head gates as
    scalars and agree with float64 qed_naive on the broadcast gates."""
    form = FORMS[ARMS.index(arm) % 2]
    x, wide = head_case(form, ARMS.index(arm))
    kw = options(arm, ARMS.index(arm))
    ref = qed_naive(*args(wide), **kw)
    assert_outputs_close(qed_chunk(*args(x), **kw), ref, atol=1e-10)
    assert_outputs_close(qed_recurrent(*args(x), **kw), ref, atol=1e-10)


@pytest.mark.parametrize("arm", ARMS)
def test_scalar_gate_path_every_arm(arm, monkeypatch):
    """With ``g`` and ``b`` per head, qed_chunk takes the scalar-gate path (Gram matrices once per
    q/k head, the erase vector rebuilt from per-row scalars) and matches float64 qed_naive on the
    broadcast gates: every arm and probe, grouped heads (m = 2), packed sequences, both states."""
    seen = []
    monkeypatch.setattr(chunk_mod, "scalar_gate_forward", _spy(chunk_mod.scalar_gate_forward, seen))
    x, wide = head_case("gdn", 20 + ARMS.index(arm))
    kw = options(arm, 20 + ARMS.index(arm))
    assert_outputs_close(qed_chunk(*args(x), **kw), qed_naive(*args(wide), **kw), atol=1e-10)
    assert len(seen) == 1


@pytest.mark.parametrize("arm", ARMS)
def test_scalar_gate_screening_launches_against_naive(arm, monkeypatch):
    """Launches the Gram screen tries beside the rule, one value head per program with ``d`` in the
    other pass than the rule's (``scalar_gram_fwd``'s ``config``), forced through ``qed_chunk``:
    every arm, probe and option (grouped heads, packed sequences, both states) still matches
    float64 qed_naive."""
    rule_gram = scalar_gram.gram_config

    def one_value_head_per_program(K, group, probes, direction):
        warps, stages, _, _, d_late = rule_gram(K, group, probes, direction)
        return warps, stages, 1, None, not d_late

    monkeypatch.setattr(scalar_gram, "gram_config", one_value_head_per_program)
    x, wide = head_case("gdn", 40 + ARMS.index(arm))
    kw = options(arm, 40 + ARMS.index(arm))
    assert_outputs_close(qed_chunk(*args(x), **kw), qed_naive(*args(wide), **kw), atol=1e-10)


@pytest.mark.parametrize("case", ["one value head per q/k head", "three per q/k head", "four per q/k head",
                                  "given d", "w per channel", "no qk norm", "float32"])
def test_scalar_gate_path_variants(case):
    """The scalar-gate path against float64 qed_naive beyond the arms: group sizes 1, 3 and 4 (K
    not a power of two; from two on the Gram stage's rule writes ``d`` in its first pass), a given
    direction ``d`` (its own ``D K^T``), a per-channel write gate, no qk L2 norm, float32 inputs
    (tf32x3 products)."""
    H_, HV_ = {"one value head per q/k head": (3, 3), "three per q/k head": (1, 3),
               "four per q/k head": (1, 4)}.get(case, (2, 4))
    x = grouped_inputs(B=2, T=45, H=H_, HV=HV_, K=24, V=8, seed=31, lam_token=True)
    x["g"], x["b"] = x["g"][..., 0], x["b"][..., 0]
    if case != "w per channel":
        x["w"] = x["w"][..., 0]
    kw = dict(arm="full", output_final_state=True, return_probes=True,
              initial_state=torch.randn(2, HV_, 24, 8, dtype=F64, generator=torch.Generator().manual_seed(3)))
    if case == "given d":
        kw["d"] = torch.randn(2, 45, HV_, 24, dtype=F64, generator=torch.Generator().manual_seed(4))
    if case == "no qk norm":
        kw["use_qk_l2norm"] = False
        x["k"] = x["k"] / x["k"].norm(dim=-1, keepdim=True)
    ref = qed_naive(*args(x), **kw)
    if case == "float32":
        x = {n: t.float() for n, t in x.items()}
        kw["initial_state"] = kw["initial_state"].float()
    o, s, p = qed_chunk(*args(x), **kw)
    got = (o.double(), s.double(), {n: t.double() for n, t in p.items()})
    assert_outputs_close(got, ref, atol=2e-5 if case == "float32" else 1e-10)
    if case == "given d":
        torch.testing.assert_close(got[2]["d"], kw["d"], atol=0, rtol=0)


@pytest.mark.parametrize("per_program", [0, 2])
def test_gram_config_value_heads_per_program_must_divide_the_group(per_program):
    """``scalar_gram_fwd``'s screening ``config``: value heads per program must divide the group of
    ``HV // H`` (here 3); anything else is refused by name before anything is allocated."""
    x = grouped_inputs(B=1, T=16, H=1, HV=3, K=8, V=8, seed=1, lam_token=False)
    with pytest.raises(ValueError, match=f"value heads per program must be a positive divisor of HV // H = 3, "
                                         f"got {per_program}"):
        scalar_gram.scalar_gram_fwd(types.SimpleNamespace(q=x["q"]), x["g"][..., 0], lay=None,
                                    inter_dtype=torch.float64, probes=False, config=(4, 1, per_program, None, True))


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("heads", [(2, 2), (1, 3)])
def test_scalar_gate_norms_folded_or_stored(heads, fold, monkeypatch):
    """The Gram stage either stores the queries' and keys' reciprocal norms, folded in by the W/U
    and output stages, or the normalised vectors themselves (``scalar_gram.folds_norms``'s
    rule picks): both ways, forced, at group sizes 1 and 3, match float64 qed_naive in the output,
    the final state and every probe (``Sd`` and ``d`` built from the folded or stored rows). The
    rule folds for one value head per q/k head without ``d`` only."""
    assert scalar_gram.folds_norms(16, 16, writes_d=False)
    assert not scalar_gram.folds_norms(16, 16, writes_d=True)
    assert not scalar_gram.folds_norms(16, 32, writes_d=False)
    monkeypatch.setattr(scalar_gram, "folds_norms", lambda *a, **k: fold)
    made = recorded_grams(monkeypatch)
    H_, HV_ = heads
    x = grouped_inputs(B=2, T=45, H=H_, HV=HV_, K=24, V=8, seed=43, lam_token=True)
    x["g"], x["b"], x["w"] = (x[n][..., 0] for n in ("g", "b", "w"))
    kw = dict(arm="full", output_final_state=True, return_probes=True,
              initial_state=torch.randn(2, HV_, 24, 8, dtype=F64, generator=torch.Generator().manual_seed(5)))
    assert_outputs_close(qed_chunk(*args(x), **kw), qed_naive(*args(x), **kw), atol=1e-10)
    ((gram, _),) = made
    assert (gram.rq is not None, gram.qn is not None) == (fold, not fold)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the flagged rows' 0 / 0, replaced
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
@pytest.mark.parametrize("layout", ["one sequence", "two sequences", "packed"])
def test_scalar_gate_sd_patched_where_the_residual_form_divides_by_zero(layout, monkeypatch):
    """Arm full, in one chunk only rows with ``lam`` = 1 (the ops' bound) and ``q = k`` (unit
    vectors, no qk norm: ``rho = 1``; ``lam`` = 0.4 elsewhere), where ``1 - lam rho`` = 0 and the
    output stage's residual form of ``Sd`` (``chunk_scan.sd_form``) would divide 0 by 0: the Gram
    stage flags exactly that chunk (of the second sequence where there are two, batched or packed
    as ``[0, 50, 150]``), its ``Sd`` is formed again from the direction rows, and every output and
    probe matches float64 qed_naive (``Sd`` = 0 on those rows), the unflagged chunks' ``Sd`` from
    the residual form included. Grouped heads, per-head gates, both states."""
    assert chunk_scan.sd_form({"DIR_SOURCE": "q", "DIR_GATED": True, "DIR_PROJECTED": True}) == "residual"
    made = recorded_grams(monkeypatch)
    B_ = 2 if layout == "two sequences" else 1
    x = grouped_inputs(B=B_, T=150, H=2, HV=4, K=16, V=8, seed=51)
    x["g"], x["b"], x["w"] = (x[n][..., 0] for n in ("g", "b", "w"))
    x["q"], x["k"] = (t / t.norm(dim=-1, keepdim=True) for t in (x["q"], x["k"]))
    x["q"][-1, 70:80] = x["k"][-1, 70:80]
    x["lam"] = torch.full((B_, 150, 4), 0.4, dtype=F64)
    x["lam"][-1, 70:80] = 1.
    N = 1 if layout == "one sequence" else 2
    kw = dict(arm="full", use_qk_l2norm=False, output_final_state=True, return_probes=True,
              initial_state=torch.randn(N, 4, 16, 8, dtype=F64, generator=torch.Generator().manual_seed(6)),
              cu_seqlens=torch.tensor([0, 50, 150]) if layout == "packed" else None)
    got = qed_chunk(*args(x), **kw)
    ref = qed_naive(*args(x), **kw)
    assert_outputs_close(got, ref, atol=1e-10)
    ((gram, _),) = made
    flagged = {"one sequence": 1, "two sequences": 4, "packed": 1}[layout]
    assert gram.patch.tolist() == [[int(c == flagged)] * 4 for c in range(len(gram.patch))]
    assert ref[2]["Sd"][-1, 70:80].abs().max() < 1e-12 < ref[2]["Sd"][-1, 80:].abs().max()


@pytest.mark.parametrize("probes", [False, ("e", "rho"), ("d",), ("Sd",)])
@pytest.mark.parametrize("heads", [(3, 3), (2, 4)])
def test_scalar_gate_output_in_the_scan_unless_sd_is_asked_for(heads, probes, monkeypatch):
    """Where the rule lets it (forced here: ``chunk_scan.scan_forms_output``, whose GPU rule is
    ``tests/test_chunk.py::test_output_formed_in_the_scan_where_it_runs_value_blocks_of_64_three_deep``)
    and ``Sd`` is not asked for, the state scan forms the output itself (``chunk_state_fwd`` with
    ``o``; no chunk-start states or residuals stored, no output launch); with ``Sd``, the scan
    stores them for the output stage. Either way ``o``, the final state and the probes asked for
    match float64 qed_naive: the norms folded (one value head per q/k head) or stored (grouped),
    packed sequences, both states, per-token lambda."""
    monkeypatch.setattr(chunk_mod, "scan_forms_output", lambda *a, **k: True)
    scans = recorded_scans(monkeypatch)
    H_, HV_ = heads
    x = grouped_inputs(B=1, T=150, H=H_, HV=HV_, K=24, V=16, seed=61, lam_token=True)
    x["g"], x["b"], x["w"] = (x[n][..., 0] for n in ("g", "b", "w"))
    kw = dict(arm="full", output_final_state=True, return_probes=probes, cu_seqlens=torch.tensor([0, 70, 150]),
              initial_state=torch.randn(2, HV_, 24, 16, dtype=F64, generator=torch.Generator().manual_seed(7)))
    assert_outputs_close(qed_chunk(*args(x), **kw), qed_naive(*args(x), **kw), atol=1e-10)
    in_scan = not probes or "Sd" not in probes
    assert scans == [(in_scan, not in_scan)]


def test_scalar_gate_state_scan_value_blocks_agree(monkeypatch):
    """The scalar-gate state scan at value blocks of 16 (what the rule takes for a few long
    sequences on a GPU) and of 64: the same outputs, states and probes (the value axis only splits
    independent columns), both matching float64 qed_naive. Float32 inputs: the interpreter has no
    bf16 products, so the launch is forced rather than chosen by the rule (its choices are
    ``tests/test_chunk.py::test_row_decay_state_scan_rule``)."""
    x = grouped_inputs(B=1, T=70, H=1, HV=2, K=32, V=64, seed=41, device=DEVICE)
    x["g"], x["b"], x["w"] = (x[n][..., 0] for n in ("g", "b", "w"))
    kw = dict(arm="full", output_final_state=True, return_probes=True)
    ref = qed_naive(*args(x), **kw)
    x32 = {n: t.float() for n, t in x.items()}
    runs = {}
    for launch in ((16, 4, 4), (64, 8, 1)):
        monkeypatch.setattr(chunk_scan, "state_config", lambda *a, launch=launch, **k: launch)
        o, s, p = runs[launch[0]] = qed_chunk(*args(x32), **kw)
        assert_outputs_close((o.double(), s.double(), {n: t.double() for n, t in p.items()}), ref, atol=2e-5)
    (o16, s16, p16), (o64, s64, p64) = runs[16], runs[64]
    torch.testing.assert_close(o16, o64, atol=1e-6, rtol=0)
    torch.testing.assert_close(s16, s64, atol=1e-6, rtol=0)
    for n in p16:
        torch.testing.assert_close(p16[n], p64[n], atol=1e-6, rtol=0)


@pytest.mark.parametrize("form", FORMS)
def test_chunk_major_grid_beyond_the_axis_limit(form, monkeypatch):
    """Per-chunk launches put the heads on the grid's first axis while the chunks fit the second
    (``chunk_common.heads_first``); past CUDA's 65535 they go chunk-major. With the limit at 1
    every launch goes chunk-major and the results are float64 qed_naive's (packed sequences,
    states, every probe)."""
    monkeypatch.setattr(chunk_common, "GRID_AXIS_LIMIT", 1)
    assert chunk_common.heads_first((3, 8))[1] is False
    x, wide = head_case(form, 40)
    kw = options("full", 40)
    assert_outputs_close(qed_chunk(*args(x), **kw), qed_naive(*args(wide), **kw), atol=1e-10)


def test_per_head_decay_with_channel_erase_gate():
    """A per-head ``g`` with a per-channel ``b`` (no model's layout) runs the per-channel kernels
    on ``g`` broadcast to its channels: float64 qed_naive's values, probes and states."""
    x = grouped_inputs(B=1, T=70, H=2, HV=4, K=16, V=8, seed=13, lam_token=True)
    x["g"] = x["g"][..., 0]
    kw = dict(arm="full", output_final_state=True, return_probes=True, cu_seqlens=torch.tensor([0, 23, 70]))
    assert_outputs_close(qed_chunk(*args(x), **kw), qed_naive(*args(x), **kw), atol=1e-10)


@pytest.mark.parametrize("op", [qed_naive, qed_chunk_torch, qed_chunk, qed_recurrent])
def test_probe_subset(op):
    """``return_probes`` given as names returns exactly those probes, equal to the full request's;
    each probe alone; an unknown name or a bare string is a ValueError naming the argument."""
    x, _ = head_case("gdn", 5)
    full = op(*args(x), arm="full", return_probes=True)[2]
    some = op(*args(x), arm="full", return_probes=("Sd", "e"))[2]
    assert list(some) == ["Sd", "e"]
    for name in some:
        torch.testing.assert_close(some[name], full[name], atol=0, rtol=0)
    for name in full:
        alone = op(*args(x), arm="full", return_probes=[name])[2]
        assert list(alone) == [name]
        torch.testing.assert_close(alone[name], full[name], atol=0, rtol=0)
    assert op(*args(x), arm="full", return_probes=())[2] is None
    with pytest.raises(ValueError, match=r"`return_probes` names unknown probes \['S'\]"):
        op(*args(x), arm="full", return_probes=("S", "e"))
    with pytest.raises(ValueError, match="`return_probes` must be a bool or a collection of probe names"):
        op(*args(x), arm="full", return_probes="e")


def test_probe_request_orders_every_request_as_the_probes_are_ordered():
    """``probe_request``: every ordering of every set of probe names, given as a tuple, a list or
    a set, asks for those names in ``PROBE_NAMES`` order; entries that are not probe names,
    hashable or not, are refused by name."""
    import itertools

    from qedprobe.kernels.qed.inputs import PROBE_NAMES, probe_request
    for r in range(len(PROBE_NAMES) + 1):
        for names in itertools.permutations(PROBE_NAMES, r):
            expected = tuple(n for n in PROBE_NAMES if n in names)
            for given in (names, list(names), set(names), names + names[:1]):
                assert probe_request("op", given) == expected
    assert probe_request("op", True) == PROBE_NAMES and probe_request("op", False) == probe_request("op", None) == ()
    for bad in ((["e"],), (1,), ("e", 1), (True,)):
        with pytest.raises(ValueError, match="op: `return_probes` must be a bool or a collection of probe names"):
            probe_request("op", bad)


def _spy(fn, calls):
    """``fn`` recording each call in ``calls``."""
    def spy(*a, **kw):
        calls.append(1)
        return fn(*a, **kw)
    return spy


def test_differentiable_chunk_falls_back_to_channel_gates():
    """With a per-head gate that requires grad, qed_chunk runs the per-channel path (the backward
    is per channel) and its gradients are qed_naive's, summed over the channels."""
    x, _ = head_case("gdn", 3)
    x = {n: t.detach().clone().requires_grad_(n in ("g", "b", "w", "q")) for n, t in x.items()}
    kw = dict(arm="full", output_final_state=True)
    grads = []
    for op in (qed_chunk, qed_naive):
        o, s, _ = op(*args(x), **kw)
        grads.append(torch.autograd.grad((o ** 2).sum() + (s ** 2).sum(), [x[n] for n in ("g", "b", "w", "q")]))
    for name, got, ref in zip(("g", "b", "w", "q"), *grads):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-9, rtol=0, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("shape,msg", [((B, T, HV, 3), r"\[B, T, HV\] = \(1, 70, 4\)"), ((B, T, H), "per channel")])
def test_gate_shape_is_checked(shape, msg):
    x, _ = head_case("gdn", 0, device="cpu")
    x["b"] = torch.rand(*shape, dtype=F64)
    with pytest.raises(ValueError, match=r"`b` must have shape .*" + msg):
        qed_naive(*args(x))


# --- GPU --------------------------------------------------------------------------------------

def _fla_case(form, T_, dtype, seed=0, grouped=True):
    """Random bf16/float32 inputs at a model-like shape, K = V = 64, 4 value heads: 2 q/k heads for
    Gated DeltaNet (grouped value heads, as Qwen3.5-4B), 4 for KDA or with ``grouped=False`` (one
    value head per q/k head, as Kimi-Linear and Qwen3.5-0.8B)."""
    gen = torch.Generator().manual_seed(seed)
    Bq, Hq, HVq, D = 1, 2 if form == "gdn" and grouped else 4, 4, 64
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    g = -torch.rand(Bq, T_, HVq, *(() if form == "gdn" else (D,)), generator=gen) * 0.1
    x = dict(q=r(Bq, T_, Hq, D), k=r(Bq, T_, Hq, D), v=r(Bq, T_, HVq, D), g=g,
             b=torch.rand(Bq, T_, HVq, generator=gen))
    return {n: t.to("cuda", dtype if n in ("q", "k", "v") else torch.float32) for n, t in x.items()}


@gpu
@pytest.mark.parametrize("form", FORMS)
def test_gpu_lambda_zero_is_fla(form):
    """lam = 0 (any arm) is fla's Gated DeltaNet (``chunk_gated_delta_rule``, scalar gates) or KDA
    (``chunk_kda``, per-channel decay), with ``beta`` as both erase and write gate."""
    fla = pytest.importorskip("fla.ops", reason="fla is the reference here")
    x = _fla_case(form, 1000, torch.bfloat16)
    lam = torch.zeros(4, device="cuda")
    o, s, _ = qed_chunk(x["q"], x["k"], x["v"], x["g"], x["b"], x["b"], lam, arm="full", output_final_state=True)
    ref_op = fla.chunk_gated_delta_rule if form == "gdn" else fla.chunk_kda
    ro, rs = ref_op(x["q"], x["k"], x["v"], x["g"], x["b"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close("o", o, ro, 2e-2)
    assert_close("final state", s, rs, 2e-2)


@gpu
@pytest.mark.parametrize("form", FORMS)
def test_gpu_long_against_naive(form):
    """T = 4096, float32, every probe: qed_chunk and qed_recurrent with per-head gates against
    float64 qed_naive."""
    x = _fla_case(form, 4096, torch.float32, seed=1)
    x["w"] = torch.rand_like(x["b"])
    lam = torch.full((4,), 0.1, device="cuda")
    kw = dict(arm="full", output_final_state=True, return_probes=True)
    ref = qed_naive(*(x[n].double() for n in ("q", "k", "v", "g", "b", "w")), lam.double(), **kw)
    for op in (qed_chunk, qed_recurrent):
        got = op(*(x[n] for n in ("q", "k", "v", "g", "b", "w")), lam, **kw)
        assert_close(f"{op.__name__} o", got[0], ref[0], 1e-4)
        assert_close(f"{op.__name__} final state", got[1], ref[1], 1e-4)
        for name in ("rho", "d", "Sd", "e"):
            assert_close(f"{op.__name__} {name}", got[2][name], ref[2][name], 1e-4)


@gpu
@pytest.mark.parametrize("lam_value", [0.1, 0.45])
@pytest.mark.parametrize("grouped", [True, False])
def test_gpu_residual_sd_in_bf16_as_accurate_as_stacked(grouped, lam_value, monkeypatch):
    """bf16 inputs, T = 4096, arm full, every probe: ``Sd`` from the residuals (the rule,
    ``chunk_scan.sd_form``) is within 1.5x the error of ``Sd`` from the stacked direction rows
    (forced), both against float64 qed_naive on the same bf16 inputs; ``o`` is the same either way.
    Grouped value heads (``q_hat, k_hat`` stored) and one per q/k head (with ``d`` asked for: stored
    too; with ``e, Sd`` only: the norms folded)."""
    x = _fla_case("gdn", 4096, torch.bfloat16, seed=4, grouped=grouped)
    lam = torch.full((4,), lam_value, device="cuda")
    inputs = [x[n] for n in ("q", "k", "v", "g", "b", "b")]
    ref = qed_naive(*(t.double() for t in inputs), lam.double(), arm="full", return_probes=True)
    for probes in (True, ("e", "Sd")):
        got = {}
        for form in ("residual", "stacked"):
            if form == "stacked":
                monkeypatch.setattr(chunk_scan, "sd_form", lambda flags: "stacked")
            got[form] = qed_chunk(*inputs, lam, arm="full", return_probes=probes)
        monkeypatch.undo()
        errs = {form: rel_err(out[2]["Sd"], ref[2]["Sd"]) for form, out in got.items()}
        assert errs["residual"] < 1.5 * errs["stacked"] + 1e-4, errs
        assert errs["residual"] < 2e-2, errs
        assert rel_err(got["residual"][0], got["stacked"][0]) < 1e-4


@gpu
@pytest.mark.parametrize("probes", [False, ("e", "Sd")])
def test_gpu_folded_norms_against_naive(probes):
    """One value head per q/k head and no ``d`` asked for, so the Gram stage stores only the norms
    (``scalar_gram.folds_norms``): T = 4096, float32, against float64 qed_naive; and bf16 at lam = 0
    against fla's ``chunk_gated_delta_rule``."""
    fla = pytest.importorskip("fla.ops", reason="fla is the reference here")
    x = _fla_case("gdn", 4096, torch.float32, seed=3, grouped=False)
    assert scalar_gram.folds_norms(x["q"].shape[2], x["v"].shape[2], writes_d=False)
    x["w"] = torch.rand_like(x["b"])
    lam = torch.full((4,), 0.1, device="cuda")
    kw = dict(arm="full", output_final_state=True)
    inputs = [x[n] for n in ("q", "k", "v", "g", "b", "w")]
    ref = qed_naive(*(t.double() for t in inputs), lam.double(), return_probes=True, **kw)
    o, s, got = qed_chunk(*inputs, lam, return_probes=probes, **kw)
    assert_close("o", o, ref[0], 1e-4)
    assert_close("final state", s, ref[1], 1e-4)
    for name in probes or ():
        assert_close(name, got[name], ref[2][name], 1e-4)
    xb = {n: t.to(torch.bfloat16) if n in ("q", "k", "v") else t for n, t in x.items()}
    o, s, _ = qed_chunk(xb["q"], xb["k"], xb["v"], xb["g"], xb["b"], xb["b"], lam * 0, **kw)
    ro, rs = fla.chunk_gated_delta_rule(xb["q"], xb["k"], xb["v"], xb["g"], xb["b"], output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    assert_close("o at lam = 0", o, ro, 2e-2)
    assert_close("final state at lam = 0", s, rs, 2e-2)


@gpu
@pytest.mark.parametrize("probes", [False, True])
@pytest.mark.parametrize("D", [16, 32])
def test_gpu_narrow_float32_heads_against_naive(D, probes):
    """float32, K = V = 16 and 32 (a tiny model's heads: value blocks narrower than 32), with and
    without probes: the scalar-gate path against float64 qed_naive (its output kernel's launch rule
    must give a configuration that compiles to in-bounds code, ``chunk_scan.scalar_output_config``)."""
    gen = torch.Generator().manual_seed(2)
    x = dict(q=torch.randn(1, 64, 2, D, generator=gen), k=torch.randn(1, 64, 2, D, generator=gen),
             v=torch.randn(1, 64, 4, D, generator=gen), g=-0.1 * torch.rand(1, 64, 4, generator=gen),
             b=torch.rand(1, 64, 4, generator=gen))
    x = {n: t.cuda() for n, t in x.items()}
    lam = torch.full((4,), 0.1, device="cuda")
    kw = dict(arm="full", output_final_state=True, return_probes=probes, use_qk_l2norm=True)
    args = [x[n] for n in ("q", "k", "v", "g", "b", "b")]
    got = qed_chunk(*args, lam, **kw)
    ref = qed_naive(*(t.double() for t in args), lam.double(), **kw)
    assert_close("o", got[0], ref[0], 1e-4)
    assert_close("final state", got[1], ref[1], 1e-4)
    for name in ref[2] if probes else ():
        assert_close(name, got[2][name], ref[2][name], 1e-4)


@gpu
@pytest.mark.parametrize("arm", [*ARMS, "given d"])
def test_gpu_every_arm_against_naive(arm):
    """Every arm and a given direction through the compiled scalar-gate path (T = 1000 in float32,
    grouped value heads, packed sequences, both states, every probe) against float64 qed_naive:
    ``nogate``, ``rand`` and a given ``d`` take the output stage's stacked launch, the others its
    residual form of ``Sd`` (``chunk_scan.sd_form``)."""
    x = _fla_case("gdn", 1000, torch.float32, seed=7)
    x["w"] = torch.rand_like(x["b"])
    gen = torch.Generator().manual_seed(8)
    lam = (0.3 * torch.rand(1, 1000, 4, generator=gen)).cuda()
    kw = dict(arm="full" if arm == "given d" else arm, output_final_state=True, return_probes=True,
              z=z_for(arm, 4, 64, dtype=torch.float32, device="cuda"), cu_seqlens=torch.tensor([0, 300, 1000]).cuda(),
              initial_state=torch.randn(2, 4, 64, 64, generator=gen).cuda())
    if arm == "given d":
        kw["d"] = torch.randn(1, 1000, 4, 64, generator=gen).cuda()
    inputs = [x[n] for n in ("q", "k", "v", "g", "b", "w")] + [lam]
    wide = {n: t.double() if torch.is_tensor(t) and t.is_floating_point() else t for n, t in kw.items()}
    ref = qed_naive(*(t.double() for t in inputs), **wide)
    got = qed_chunk(*inputs, **kw)
    assert_close("o", got[0], ref[0], 1e-4)
    assert_close("final state", got[1], ref[1], 1e-4)
    for name in ("rho", "d", "Sd", "e"):
        if arm == "gdn2" and name in ("d", "Sd"):
            assert not got[2][name].any(), f"{name} of gdn2 must be 0"
        else:
            assert_close(name, got[2][name], ref[2][name], 1e-4)


@gpu
def test_gpu_patch_launch_against_naive(monkeypatch):
    """Arm full with ``lam`` = 1 and ``q = k`` on rows 130-139 (``1 - lam rho`` = 0 there; ``lam``
    0.4 elsewhere), float32, T = 1000, grouped value heads: the Gram stage flags exactly chunk 2 of
    every value head, the patch launch forms its ``Sd`` from the direction rows (0 on those rows),
    and everything matches float64 qed_naive."""
    made = recorded_grams(monkeypatch)
    x = _fla_case("gdn", 1000, torch.float32, seed=9)
    x["q"], x["k"] = (t / t.norm(dim=-1, keepdim=True) for t in (x["q"], x["k"]))
    x["q"][:, 130:140] = x["k"][:, 130:140]
    lam = torch.full((1, 1000, 4), 0.4, device="cuda")
    lam[:, 130:140] = 1.
    inputs = [x[n] for n in ("q", "k", "v", "g", "b", "b")] + [lam]
    kw = dict(arm="full", use_qk_l2norm=False, output_final_state=True, return_probes=True)
    ref = qed_naive(*(t.double() for t in inputs), **kw)
    got = qed_chunk(*inputs, **kw)
    ((gram, _),) = made
    assert gram.patch.tolist() == [[int(c == 2)] * 4 for c in range(len(gram.patch))]
    assert_close("o", got[0], ref[0], 1e-4)
    assert_close("final state", got[1], ref[1], 1e-4)
    for name in ("rho", "d", "Sd", "e"):
        assert_close(name, got[2][name], ref[2][name], 1e-4)
    assert got[2]["Sd"][:, 130:140].abs().max() < 1e-4 < got[2]["Sd"][:, 140:].abs().max()


@gpu
@pytest.mark.parametrize("grouped", [True, False])
def test_gpu_output_formed_in_the_scan_at_its_launch(grouped, monkeypatch):
    """bf16, K = V = 128, T = 1000, lam 0.1, the scan forming the output at the launch the rule
    gives it (value blocks of 64, three deep; forced, since the rule depends on the shape and the
    GPU's SM count): ``o`` and the final state within bf16 rounding of the output stage's (the same
    inputs with ``Sd`` asked for) and of float64 qed_naive on the same bf16 inputs, the norms folded
    (one value head per q/k head) or stored; at lam = 0 fla's ``chunk_gated_delta_rule``."""
    fla = pytest.importorskip("fla.ops", reason="fla is the reference here")
    gen = torch.Generator().manual_seed(11)
    H_ = 2 if grouped else 4
    x = dict(q=torch.randn(1, 1000, H_, 128, generator=gen), k=torch.randn(1, 1000, H_, 128, generator=gen),
             v=torch.randn(1, 1000, 4, 128, generator=gen), g=-0.1 * torch.rand(1, 1000, 4, generator=gen),
             b=torch.rand(1, 1000, 4, generator=gen))
    x = {n: t.to("cuda", torch.bfloat16 if n in ("q", "k", "v") else torch.float32) for n, t in x.items()}
    inputs = [x[n] for n in ("q", "k", "v", "g", "b", "b")]
    lam = torch.full((4,), 0.1, device="cuda")
    ref = qed_naive(*(t.double() for t in inputs), lam.double(), output_final_state=True)
    staged = qed_chunk(*inputs, lam, output_final_state=True, return_probes=("Sd",))
    monkeypatch.setattr(chunk_mod, "scan_forms_output", lambda *a, **k: True)
    scans = recorded_scans(monkeypatch)
    monkeypatch.setattr(chunk_scan, "state_config", lambda *a, **k: (64, 4, 3))
    o, s, _ = qed_chunk(*inputs, lam, output_final_state=True)
    assert scans == [(True, False)]
    assert rel_err(o, staged[0]) < 1e-2 and rel_err(s, staged[1]) < 1e-2
    assert_close("o", o, ref[0], 2e-2)
    assert_close("final state", s, ref[1], 2e-2)
    o, s, _ = qed_chunk(*inputs, lam * 0, output_final_state=True)
    ro, rs = fla.chunk_gated_delta_rule(*inputs[:5], output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close("o at lam = 0", o, ro, 2e-2)
    assert_close("final state at lam = 0", s, rs, 2e-2)
