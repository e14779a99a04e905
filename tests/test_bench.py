"""bench/ holds registered benchmarks only, and its runner runs them (CPU smoke of the sweep benchmark);
the forward traffic model's written bytes are those of the kernels' wrappers."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import chunk_inputs, low_precision, op_args

BENCH = Path(__file__).resolve().parents[1] / "bench"


sys.path.insert(0, str(BENCH))  # the runner imports its sibling registry.py by that name
try:
    import forward_traffic
    import hf_models
    import recurrent_decode
    import registry
    import run
    import sweep as sweep_bench
finally:  # every copy (the runner adds its own): no bench script may shadow a package for later tests
    while str(BENCH) in sys.path:
        sys.path.remove(str(BENCH))


def test_every_bench_script_is_registered():
    scripts = {p.name for p in BENCH.glob("*.py")} - set(registry.SHARED_MODULES)
    assert scripts == {b.script for b in registry.BENCHMARKS.values()}
    assert all(b.path.is_file() for b in registry.BENCHMARKS.values())
    assert not [p.name for p in BENCH.iterdir() if p.suffix not in (".py", "") and p.name != "__pycache__"]


def sibling_imports(script: Path) -> set[str]:
    """The modules of ``bench/`` that ``script`` imports by name (top level or inside functions)."""
    siblings = {p.stem for p in BENCH.glob("*.py")}
    names = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names & siblings


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py") if sibling_imports(p)))
def test_bench_scripts_import_their_siblings_under_safe_path(script):
    """A script that imports another module of bench/ puts bench/ on sys.path itself: the device
    runs them as ``python3 -P bench/NAME.py`` (no script folder on the path) from another folder."""
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('m', sys.argv[1]); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec))")
    done = subprocess.run([sys.executable, "-P", "-c", code, str(BENCH / script)], cwd=BENCH.parent.parent,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_decode_host_paths_time_both_wrappers_and_restore_the_launch():
    """``recurrent_decode.py --host-only``: both wrappers timed with the launch stubbed out (their
    host paths take microseconds, not the interpreter's milliseconds), the launch restored after."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    real_runs = (JITFunction.run, InterpretedFunction.run)
    got = recurrent_decode.host_paths(calls=20)
    assert (JITFunction.run, InterpretedFunction.run) == real_runs
    assert set(got) >= {"qed_host_us", "fla_host_us"}
    assert 0 < got["qed_host_us"] < 1000 and 0 < got["fla_host_us"] < 1000


def test_hf_layer_host_paths_time_the_hooked_layer_and_the_native_function():
    """``recurrent_decode.py --host-only``, second line: an adapted Qwen3.5-shaped layer's hooked,
    injected decode call and fla's ``fused_recurrent_gated_delta_rule`` timed with the launch
    stubbed out, on grouped value heads, the launch restored after."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    real_runs = (JITFunction.run, InterpretedFunction.run)
    got = recurrent_decode.hf_layer_host_paths(B=2, H=2, HV=4, K=16, calls=20)
    assert (JITFunction.run, InterpretedFunction.run) == real_runs
    assert {k: got[k] for k in ("B", "H", "HV", "K")} == {"B": 2, "H": 2, "HV": 4, "K": 16}
    assert 0 < got["qed_hf_layer_host_us"] < 2000 and 0 < got["fla_gdn_host_us"] < 2000


def test_fla_on_cpu_sends_the_native_decode_function_to_fla_and_restores_it():
    """``recurrent_decode.fla_on_cpu``: inside the block transformers' decode recurrence (through
    qedprobe's route) hands CPU tensors to fla, whose launch runs (here a counting stub); outside
    it takes its PyTorch code again (no launch)."""
    import importlib

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from qedprobe.hf import route
    from qedprobe.hf.families import modeling_module_name, routed_functions
    name = modeling_module_name("qwen3_5_text")
    route.install(name, routed_functions("qwen3_5_text"))
    fn = importlib.import_module(name).torch_recurrent_gated_delta_rule
    B, H, K = 2, 2, 16
    q, k, v = (torch.randn(B, 1, H, K) for _ in range(3))
    args = dict(g=-torch.rand(B, 1, H), beta=torch.rand(B, 1, H), initial_state=torch.zeros(B, H, K, K),
                output_final_state=True, use_qk_l2norm_in_kernel=True)
    launched = []
    with recurrent_decode.stubbed_launches():
        stub = JITFunction.run
        JITFunction.run = InterpretedFunction.run = lambda self, *a, **kw: launched.append(1)
        try:
            with recurrent_decode.fla_on_cpu(fn):
                fn(q, k, v, **args)
            inside = len(launched)
            o, state = fn(q, k, v, **args)
        finally:
            JITFunction.run = InterpretedFunction.run = stub
    assert inside > 0 and len(launched) == inside
    assert o.shape == (B, 1, H, K) and torch.isfinite(o).all()


def test_hf_decoder_layer_host_paths_time_each_decode_variant_and_restore_the_launch():
    """``recurrent_decode.py --host-only``, third line: a tiny Qwen3.5's Gated DeltaNet layer's
    decode step timed for each of ``hf_models.DECODE_VARIANTS`` with the launch stubbed out, the
    launch and the torch thread count restored after."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    real_runs, threads = (JITFunction.run, InterpretedFunction.run), torch.get_num_threads()
    got = recurrent_decode.hf_decoder_layer_host_paths(B=2, calls=2, rounds=1)
    assert (JITFunction.run, InterpretedFunction.run) == real_runs and torch.get_num_threads() == threads
    assert {k: got[k] for k in ("B", "H", "HV", "K")} == {"B": 2, "H": 2, "HV": 2, "K": 16}
    assert list(got["layer_step_us"]) == list(hf_models.DECODE_VARIANTS)
    assert all(0 < t < 1e5 for t in got["layer_step_us"].values())


def test_step_counts_read_launches_aten_ops_and_op_time_per_step():
    """``step_counts`` on a real CPU profile (two steps of three aten ops each) and on the launch
    events a CUDA profile adds (torch's ``cudaLaunchKernel``, Triton's ``cuLaunchKernelEx``)."""
    from types import SimpleNamespace

    from torch.profiler import ProfilerActivity, profile
    x, y = torch.ones(4), torch.ones(4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):  # tensor operands: a Python scalar would add its own aten::to copies
            torch.add(x, y), torch.mul(x, y), torch.mul(y, x)
    averages = list(prof.key_averages())
    counts = hf_models.step_counts(averages, steps=2)
    assert counts["aten_ops"] == 3 and counts["launches"] == 0
    assert counts["op_cpu_ms"] > 0
    assert counts["op_cpu_ms"] == pytest.approx(sum(e.self_cpu_time_total for e in averages) / 2e3)
    launches = [SimpleNamespace(key=k, count=n, self_cpu_time_total=0.0)
                for k, n in (("cudaLaunchKernel", 10), ("cuLaunchKernelEx", 4), ("cudaMemcpyAsync", 6))]
    assert hf_models.step_counts(averages + launches, steps=2)["launches"] == 7


def test_host_synchronisations_count_the_lines_that_waited(monkeypatch):
    """``hf_models.host_synchronisations``: the warnings torch's sync debug mode raises, counted by
    the Python line that raised them (other warnings left out), the mode restored after."""
    import warnings
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def run():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation")  # line A
        warnings.warn("called a synchronizing CUDA operation")  # line B
        warnings.warn("something else")

    got = hf_models.host_synchronisations(run)
    where = {int(line.rsplit(":", 1)[1]): n for line, n in got.items()}
    first = min(where)
    assert where == {first: 3, first + 1: 1} and all(line.startswith(f"{__file__}:") for line in got)
    assert modes == ["warn", "default"]


def test_decode_variants_alternate_and_leave_the_model_native(monkeypatch, capsys):
    """``hf_models.interleaved_decode`` on a tiny random Qwen3.5 (CPU): each round measures the
    native model, the adapted one (the same logits, no hook firing) and the injected one (other
    logits, the probe hooks firing), in that order; each variant's round figures after the warm-up
    round are returned in order, and each round's figure is logged; the model is native again
    afterwards."""
    monkeypatch.setattr(hf_models, "DEV", "cpu")
    fired = []
    monkeypatch.setattr(hf_models, "PROBE_HOOKS", [(lambda name: name.endswith("hook_e"),
                                                    lambda act, hook: fired.append(hook.name))])
    model = hf_models.random_qwen35(16, small=True).float()
    ids = torch.randint(2, model.config.vocab_size, (1, 12))
    with torch.no_grad():
        native = model(ids).logits
        seen = []

        def measure():
            before = len(fired)
            seen.append((torch.equal(model(ids).logits, native), len(fired) > before))
            return [float(len(seen))]

        got = hf_models.interleaved_decode(model, measure, rounds=3)
        assert torch.equal(model(ids).logits, native)
    assert seen == [(True, False), (True, False), (False, True)] * 4
    assert got == dict(zip(hf_models.DECODE_VARIANTS, ([4.0, 7.0, 10.0], [5.0, 8.0, 11.0], [6.0, 9.0, 12.0])))
    logged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("decode round")]
    assert logged[0] == "decode round 0 (warm-up), native: median 1.000 ms, min 1.000, max 1.000, 1 steps"
    assert logged[-1] == "decode round 3, injected, hook_e + hook_Sd: median 12.000 ms, min 12.000, max 12.000, 1 steps"
    assert len(logged) == 12


def test_generate_section_writes_the_decode_step_rows_alone(monkeypatch, tmp_path):
    """``--sections generate`` (``hf_models.generate_rows``): for each value-head count, one row per
    decode variant on a model with that many value heads, each against native's figure; no
    prefill rows."""
    monkeypatch.setattr(hf_models, "DEV", "cpu")
    monkeypatch.setattr(hf_models.torch.cuda, "get_device_name", lambda *a: "test device")
    heads = []
    monkeypatch.setattr(hf_models, "generate_steps", lambda model, ids: None)
    asked = []
    medians = ([30., 40., 32.], [31., 38., 36.], [33., 46., 31.])  # native's rounds drift: 40 in the second
    monkeypatch.setattr(hf_models, "interleaved_decode", lambda model, measure, rounds: (
        heads.append(model.config.linear_num_value_heads) or asked.append(rounds)
        or dict(zip(hf_models.DECODE_VARIANTS, medians))))
    rows = hf_models.Rows(str(tmp_path / "rows.json"), "abc1234")
    hf_models.generate_rows(rows, lambda: 1e9, small=True, value_heads=(16, 32), rounds=3)
    assert heads == [2, 4]  # the small models' value heads: HV // 8
    assert asked == [3, 3]  # --rounds reaches each model's alternation
    got = [(r["name"], r["shape"], r["ms"], r["ratio"]) for r in json.load(open(tmp_path / "rows.json"))]
    B, T = hf_models.generate_batch(True)
    paired = (None, round(31 / 30, 4), round(33 / 30, 4))  # medians of the per-round ratios (pooled: 36 / 32, 33 / 32)
    assert got == [(f"decode step in generate ({name})", f"B{B} T{T} HV{hv} decode", ms, ratio)
                   for hv in (16, 32) for name, ms, ratio in zip(hf_models.DECODE_VARIANTS, (32., 36., 33.), paired)]
    assert all(r["native_ms"] == 32. for r in json.load(open(tmp_path / "rows.json")) if r["ratio"] is not None)


def test_generate_section_pools_the_rounds_of_a_value_head_count_named_twice(monkeypatch, tmp_path):
    """``--value-heads 16,32,32,16``: each count's two models' rounds pooled into one row per
    variant (median over all eight rounds of the paired ratios), written after its last model; a
    budget that cuts the section still writes the rounds that ran."""
    monkeypatch.setattr(hf_models, "DEV", "cpu")
    monkeypatch.setattr(hf_models.torch.cuda, "get_device_name", lambda *a: "test device")
    monkeypatch.setattr(hf_models, "generate_steps", lambda model, ids: None)
    calls = iter([  # per model: native, adapted, injected rounds
        ([10., 20.], [11., 20.], [12., 22.]), ([30., 30.], [30., 33.], [30., 30.]),
        ([40., 40.], [40., 40.], [44., 44.]), ([50., 50.], [45., 50.], [50., 55.])])
    monkeypatch.setattr(hf_models, "interleaved_decode",
                        lambda model, measure, rounds: dict(zip(hf_models.DECODE_VARIANTS, next(calls))))
    rows = hf_models.Rows(str(tmp_path / "rows.json"), "abc1234")
    hf_models.generate_rows(rows, lambda: 1e9, small=True, value_heads=(16, 32, 32, 16))
    got = [(r["shape"].split()[2], r["ms"], r["ratio"]) for r in json.load(open(tmp_path / "rows.json"))]
    # 32: rounds of models 2 and 3; 16: of models 1 and 4, written last.
    assert got == [("HV32", 35., None), ("HV32", 36.5, 1.0), ("HV32", 37., round((1 + 1.1) / 2, 4)),
                   ("HV16", 35., None), ("HV16", 32.5, round((1 + 1.0) / 2, 4)),
                   ("HV16", 36., round((1.1 + 1.1) / 2, 4))]
    budget = iter([1e9, 1e9, 0.])  # the third model cut
    calls = iter([([10.], [11.], [12.]), ([30.], [33.], [36.])])
    rows = hf_models.Rows(str(tmp_path / "cut.json"), "abc1234")
    hf_models.generate_rows(rows, lambda: next(budget), small=True, value_heads=(16, 32, 32, 16))
    got = [(r["shape"].split()[2], r["ms"], r["ratio"]) for r in json.load(open(tmp_path / "cut.json"))]
    assert got == [("HV16", 10., None), ("HV16", 11., 1.1), ("HV16", 12., 1.2),
                   ("HV32", 30., None), ("HV32", 33., 1.1), ("HV32", 36., 1.2)]


def test_step_clock_times_each_decode_step_inside_generate(monkeypatch):
    """``hf_models.generate_steps``: one time per decode step (the prefill's token is none), from
    a stopping criterion that stops nothing."""
    monkeypatch.setattr(hf_models, "DEV", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    model = hf_models.random_qwen35(16, small=True).float()
    steps = hf_models.generate_steps(model, torch.randint(2, model.config.vocab_size, (2, 8)))()
    assert len(steps) == hf_models.GENERATE["steps"] and all(t > 0 for t in steps)


def test_unknown_benchmark_names_the_choices():
    with pytest.raises(ValueError, match="expected one of .*'kernels'"):
        registry.get_benchmark("kernel")
    with pytest.raises(SystemExit):
        run.main(["kernel"])


def test_list_names_every_benchmark(capsys):
    assert run.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert listed == list(registry.BENCHMARKS)


def test_runner_runs_the_sweep_benchmark_and_records_the_machine(tmp_path, capsys):
    args = ["--tiny", "--device", "cpu", "--samples", "1", "--lengths", "512", "--strengths", "0,1",
            "--no-progress"]
    assert run.main(["sweep", "--out", str(tmp_path), "--", *args]) == 0
    out = capsys.readouterr().out
    res = json.loads(out[("\n" + out).rindex("\n{"):])
    assert res["rows"] == 2 and res["device"] == "cpu" and res["prompt_tokens"] > 2 * 388
    machine = json.loads((tmp_path / "sweep.machine.json").read_text())
    assert machine["benchmark"] == "sweep" and machine["command"] == ["bench/sweep.py", *args]
    assert machine["torch"] and len(machine["date_utc"]) == 10


def _sweep_bench(tmp_path, capsys, *args):
    assert run.main(["sweep", "--", "--tiny", "--device", "cpu", "--samples", "1", "--strengths", "0,1",
                     "--no-progress", "--out", str(tmp_path / "grid"), "--json", str(tmp_path / "sweep.json"),
                     *args]) == 0
    out = capsys.readouterr().out
    printed = json.loads(out[("\n" + out).rindex("\n{"):])
    assert json.loads((tmp_path / "sweep.json").read_text()) == printed
    return printed


def test_sweep_benchmark_resumes_and_sums_its_calls(tmp_path, capsys):
    first = _sweep_bench(tmp_path, capsys, "--lengths", "512")
    assert (first["rows"], first["calls"], first["untimed_rows"], first["full_grid"]) == (2, 1, 0, False)
    assert {"wall_s", "prefill_tokens_per_s", "decode_ms_per_step", "device", "date", "commit"} <= set(first)
    assert first["decode_ms_per_step_by_batch"].keys() == {"1"} and first["decode_steps"] == 2 * 10
    assert abs(sum(first["share"].values()) - 1) < 1e-3
    second = _sweep_bench(tmp_path, capsys, "--lengths", "512,1K")  # the 512 rows resume, 1K is new
    assert (second["rows"], second["calls"], second["untimed_rows"]) == (4, 2, 0)
    assert second["wall_s"] > first["wall_s"] and set(second["prefill_tokens_per_s_by_length"]) == {"512", "1024"}
    (tmp_path / "grid" / "bench_timing.json").unlink()  # as if the calls so far were killed before writing it
    third = _sweep_bench(tmp_path, capsys, "--lengths", "512,1K", "--budget", "16")
    assert (third["rows"], third["calls"], third["untimed_rows"], third["target_met"]) == (4, 1, 4, None)


def test_full_grid_estimate_scales_the_wall_by_prompt_tokens():
    """A third of the full grid's nominal prompt tokens done in 10 s: the full grid is estimated at
    30 s whatever the share of rows (here a half, which would say 20 s); none once the full grid
    is measured, for another model, or when rows were done in untimed calls."""
    total = {"wall_s": 10.0, "untimed_rows": 0, "calls": 1, "prompt_tokens": 1000, "new_tokens": 10,
             "prefill_by_length": {}, "decode_by_batch": {}, "model_build_s": 1.0, "time_s": {"prefill": 10.0}}

    def estimate(timing=total, full_grid=False, full_grid_tokens=3000):
        return sweep_bench.report(timing, rows=2, grid_rows=4, full_grid=full_grid,
                                  full_grid_tokens=full_grid_tokens, extra={})["full_grid_s_estimate"]
    assert estimate() == 30.0
    assert estimate(full_grid=True) is None and estimate(full_grid_tokens=None) is None
    assert estimate({**total, "untimed_rows": 1}) is None
    assert sweep_bench.FULL_GRID_TOKENS == 63 * 1024 * 6 * 500


@pytest.mark.parametrize("probes", [False, True])
def test_forward_traffic_model_writes_what_the_wrappers_allocate(probes):
    """Per qed_chunk forward launch, the tensors the model has it write are those the wrapper
    allocates (float32 inputs, so 4-byte intermediates in the interpreter; T=100 leaves a partial
    chunk)."""
    from qedprobe.kernels.qed.chunk import chunk_precision, direction_inputs
    from qedprobe.kernels.qed.chunk_common import chunk_layout
    from qedprobe.kernels.qed.chunk_intra import chunk_prep_fwd, chunk_scores_fwd
    from qedprobe.kernels.qed.chunk_scan import chunk_output_fwd, chunk_state_fwd
    from qedprobe.kernels.qed.chunk_wy import chunk_inverse_fwd, chunk_wy_fwd
    from qedprobe.kernels.qed.inputs import check_qed_inputs
    x, _ = low_precision(chunk_inputs(B=1, seed=0), torch.float32)
    q, k, v, g, b, w, lam = op_args(x)
    P = check_qed_inputs("qed_chunk", q, k, v, g, b, w, lam, arm="full", z=None, d=None, scale=None,
                         initial_state=None, cu_seqlens=None)
    inter, prec = chunk_precision(P, q, k, v, b, w)
    lay = chunk_layout(P, None, q.device, prec)
    xd = direction_inputs(P, q, k, b, lam, "full", None, None, True)
    kw = dict(scale=P.scale, lay=lay, inter_dtype=inter, probes=probes)
    prep = chunk_prep_fwd(xd, g, **kw)
    scores = chunk_scores_fwd(xd, prep, **kw)
    ai = chunk_inverse_fwd(scores.akk, lay=lay, out_dtype=inter)
    wy = chunk_wy_fwd(prep.ag, v, w, ai, lay=lay)
    hs, r = torch.empty(lay.NC, P.HV, P.K, P.V), torch.empty_like(v)
    chunk_state_fwd(lay, w=wy.w, u=wy.u, kg=prep.kg, gl=prep.gl, hs=hs, r=r, T=P.T, N=P.N)
    o, sd = torch.empty_like(v), (torch.empty_like(v) if probes else None)
    chunk_output_fwd(lay, qg=prep.qg, aqk=scores.aqk, hs=hs, r=r, o=o, dg=prep.dg if probes else None,
                     adk=scores.adk, sd=sd)
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
    wrote = [nbytes(*vars(prep).values()), nbytes(*vars(scores).values()), nbytes(ai), nbytes(*vars(wy).values()),
             nbytes(hs, r), nbytes(o, sd)]
    model = forward_traffic.qed_launches(forward_traffic.Shape(1, P.T, P.HV, P.K, P.V), probes, io=4)
    assert [ln.total("allocated")[1] for ln in model] == wrote
    assert o.abs().max() > 0 and (not probes or sd.abs().max() > 0)


def test_forward_traffic_joins_measured_kernel_times():
    """``--measured``: per kernel the model's bytes over the profiler's ms (names cut to 40
    characters as bench/kernel_times.py --parts writes them; fla's two L2-norm launches summed)."""
    s = forward_traffic.Shape(8, 4096, 16, 128, 128)
    qed, fla = forward_traffic.qed_launches(s, False), forward_traffic.fla_launches(s, 64, 64)
    intra = "chunk_gdn2_fwd_kernel_intra_token_parallel"
    rows = [{"name": "  qed: qed_prep_kernel", "ms": 0.5}, {"name": "  qed+probes: qed_prep_kernel", "ms": 9.0},
            {"name": f"  fla: {intra[:40]}", "ms": 0.25}, {"name": "  fla: l2norm_fwd_kernel", "ms": 0.1}]
    mb = lambda *lns: sum(sum(ln.total("unique")) for ln in lns) / 1e6  # noqa: E731
    got = forward_traffic.measured("t", qed, rows, "qed")
    assert got[2] == f"| qed_prep_kernel | {mb(qed[0]):,.0f} | 0.500 | {mb(qed[0]) / 0.5:,.0f} | " \
                     f"{mb(qed[0]) / 0.5 / 4800:.0%} |"
    assert got[3] == f"| qed_scores_kernel | {mb(qed[1]):,.0f} | no row | | |"
    assert got[-1].startswith(f"| **all with a row** | **{mb(qed[0]):,.0f}** | **0.500** |")
    got = {r.split(" | ")[0][2:]: r.split(" | ")[1:4] for r in forward_traffic.measured("t", fla, rows, "fla")[2:]}
    assert got["l2norm_fwd_kernel"] == [f"{mb(fla[0], fla[1]):,.0f}", "0.100", f"{mb(fla[0], fla[1]) / 0.1:,.0f}"]
    assert got[intra][1] == "0.250"


@pytest.mark.parametrize("mode", ["--head-gates", "--per-channel", "--output-only", "--gram-only"])
def test_launch_screen_rows_agree_with_the_rule(tmp_path, mode):
    """``scripts/scan_configs.py`` in Triton's interpreter at a tiny shape: every screened launch of
    the state scan, the output kernel and the Gram stage gives the rule configuration's results
    exactly, each kernel (and probe setting) has its rule row, and the scalar-gate screen covers
    value blocks of 16, 32, 64 at two to four stages, for the state scan alone and for the scan
    forming the output (whose ``o`` is the two launches' exactly, timed beside them); the Gram
    stage in 4 and 8 warps with ptxas' register count and capped at 128 and 168 and in 16 warps, a
    group of two value heads in one program or in two, with probes and without (``d`` in the first
    pass and in a second). With
    ``--output-only`` (scalar gates) neither a state-scan nor a Gram row, with ``--gram-only`` Gram
    rows alone."""
    out = tmp_path / "screen.json"
    args = ["--B", "1", "--T", "64", "--H", "1", "--K", "64", "--V", "64", "--json", str(out)]
    args += {"--head-gates": ["--head-gates", "--HV", "2"], "--per-channel": [],
             "--output-only": ["--head-gates", "--HV", "2", "--output-only"],
             "--gram-only": ["--head-gates", "--HV", "2", "--gram-only"]}[mode]
    done = subprocess.run([sys.executable, str(BENCH.parent / "scripts" / "scan_configs.py"), *args],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["max_diff"] == 0.0 for r in rows if "max_diff" in r)
    kinds = {(r["kernel"], r.get("probes")) for r in rows if "max_diff" in r}
    assert all(sum(r["rule"] for r in rows if (r["kernel"], r.get("probes")) == kind) >= 1 for kind in kinds)
    if mode == "--output-only":
        assert {r["kernel"] for r in rows} == {"qed_scalar_output_kernel"}
    if mode in ("--head-gates", "--gram-only"):
        gram = {(r["warps"], r["maxnreg"], r["value_heads"], r["probes"], r["d_late"]) for r in rows
                if r["kernel"] == "qed_scalar_gram_kernel"}
        assert gram >= {(w, reg, per, p, late) for w, reg in [(w, reg) for w in (4, 8) for reg in (None, 128, 168)]
                        + [(16, None)] for per in (1, 2) for p, late in ((False, True), (True, False), (True, True))}
    if mode == "--gram-only":
        assert {r["kernel"] for r in rows} == {"qed_scalar_gram_kernel"}
    if mode == "--head-gates":
        for kernel in ("qed_state_kernel (decay per row)", "qed_state_kernel forming o"):
            state = {(r["BV"], r["stages"]) for r in rows if r["kernel"] == kernel}
            assert state >= {(bv, s) for bv in (16, 32, 64) for s in (2, 3, 4)}
        assert any(r["kernel"] == "state scan + scalar output kernel (rules)" and r["ms"] > 0 for r in rows)
        assert {r.get("probes") for r in rows if r["kernel"] == "qed_scalar_output_kernel"} == {False, True}


@pytest.mark.parametrize("flag,value", [("--op-shapes", "8x"), ("--op-shapes", "8x4096,0x16"),
                                        ("--op-shapes", "8*4096"), ("--value-heads", "16,x"), ("--rounds", "0"),
                                        ("--rounds", "x")])
def test_hf_models_refuses_a_bad_shape_by_its_flag(flag, value):
    """``bench/hf_models.py`` refuses a malformed ``--op-shapes`` / ``--value-heads`` / ``--rounds``
    before it looks for CUDA: exit status 2, the flag named with the value it got."""
    done = subprocess.run([sys.executable, str(BENCH / "hf_models.py"), flag, value], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and f"{flag}:" in done.stderr and repr(value) in done.stderr, done.stderr[-500:]


def test_kernel_versions_builds_trees_from_a_commit_and_a_patch_and_times_them_in_turns(tmp_path):
    """``scripts/kernel_versions.sh``: ``build NAME=COMMIT+PATCH`` lays out the commit's package with
    the patch applied to its kernels (a patch that does not apply is refused, naming it); ``time
    --bench S --rounds 2`` runs ``S`` once per tree and round, trees taking turns, each with its
    tree first on ``PYTHONPATH``. The trees' folder lies inside a git repository, as ``.trees`` in a
    checkout does (where ``git apply`` skips every path of a patch unless run outside it)."""
    repo = BENCH.parent
    if subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("needs the repository's git history")
    script = repo / "scripts" / "kernel_versions.sh"
    old = (repo / "kernels" / "qed" / "naive.py").read_text()
    new = old.replace('"""', '"""(patched) ', 1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "naive.py").write_text(old)
    (tmp_path / "b" / "naive.py").write_text(new)
    diff = subprocess.run(["git", "diff", "--no-index", "a/naive.py", "b/naive.py"], cwd=tmp_path,
                          capture_output=True, text=True).stdout
    patch = tmp_path / "p.patch"
    patch.write_text(diff.replace("a/a/naive.py", "a/kernels/qed/naive.py").replace("b/b/naive.py",
                                                                                     "b/kernels/qed/naive.py"))
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    trees = tmp_path / "trees"
    run = lambda *args: subprocess.run(["bash", str(script), *args], capture_output=True, text=True)  # noqa: E731
    done = run("build", "--trees", str(trees), "main=HEAD", f"patched=HEAD+{patch}")
    assert done.returncode == 0, done.stderr
    assert (trees / "main" / "qedprobe" / "kernels" / "qed" / "naive.py").read_text() == old
    assert (trees / "patched" / "qedprobe" / "kernels" / "qed" / "naive.py").read_text() == new
    bad = tmp_path / "bad.patch"
    bad.write_text(diff.replace("a/a/naive.py", "a/kernels/qed/absent.py").replace("b/b/naive.py",
                                                                                    "b/kernels/qed/absent.py"))
    refused = run("build", "--trees", str(trees), f"bad=HEAD+{bad}")
    assert refused.returncode == 2 and "bad.patch does not apply" in refused.stderr
    assert sorted(p.name for p in trees.iterdir()) == ["main", "patched"]  # no half-built tree left
    stub = tmp_path / "stub.py"  # what it was run with, and a row
    stub.write_text("import os, sys\nprint(os.environ['PYTHONPATH'].split(':')[0], sys.argv[1:])\n"
                    "print('row ratio 1.0')\n")
    out = tmp_path / "out"
    done = run("time", "--trees", str(trees), "--out", str(out), "--bench", str(stub), "--rounds", "2",
               "--python", sys.executable, "--", "--sections", "op")
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stdout.splitlines() if line.startswith("==")] == [
        "== main-r1 (exit 0)", "== patched-r1 (exit 0)", "== main-r2 (exit 0)", "== patched-r2 (exit 0)"]
    log = (out / "stub-patched-r2.log").read_text().split("\n")[0]
    assert log.startswith(str(trees / "patched")) and "'--sections', 'op', '--commit', 'patched'" in log
    assert run("time", "--trees", str(trees), "--out", str(out), "--rounds", "0").returncode == 2
