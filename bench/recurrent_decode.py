"""Decode-step timing: ``qed_recurrent`` (T=1, carried state) against fla's ``fused_recurrent_gdn2``.

    python bench/recurrent_decode.py            # needs CUDA; fla optional; writes $OUT/recurrent_decode.json
    python bench/recurrent_decode.py --screen   # launch configurations of a decode step, by batch size
    python bench/recurrent_decode.py --host-only   # any machine: the two wrappers' host paths alone


``bench_decode(B, H, K, V, dtype)`` returns microseconds per step: the median of
``triton.testing.do_bench`` (it includes any host-side gap between
launches), the GPU-only time from CUDA-graph replays, and the host time per call; plus the
relative error of ``o`` against ``qed_naive`` in float64 on the same inputs.

``--host-only`` (no GPU needed) times the Python side of one decode step of each op, B=16, H=16,
K=V=128, on CPU tensors with every Triton launch replaced by a no-op: the part of the eager
decode step that the device does not set, for comparing host paths on a machine without a GPU.
Its second line does the same for one layer of a Qwen3.5-shaped model at decode (B=8, 16 q/k and
16 value heads of 128): ``qedprobe.hf``'s recurrence with QED injected and ``hook_e``, ``hook_Sd``
hooked against fla's ``fused_recurrent_gated_delta_rule``, which the native model calls. Its third
line times a whole Gated DeltaNet layer's decode step (transformers' module, with the cache) of
a tiny Qwen3.5 the same way, native, adapted with nothing hooked, and injected and hooked
(:func:`hf_decoder_layer_host_paths`).

``--screen`` times one decode step as a model's CUDA-graph decode runs it (the state updated in
place, ``inplace_final_state=True``; the CUDA-graph time of :func:`_times`) for every launch configuration of
:data:`SCREEN_CONFIGS` at the batch sizes of :data:`SCREEN_SHAPES`: the measurements behind
``default_block_config``.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time

import torch
from triton.testing import do_bench

from qedprobe.kernels.qed.fused_recurrent import default_block_config, qed_recurrent
from qedprobe.kernels.qed.naive import qed_naive

GRAPH_CALLS = 20
SCREEN_SHAPES = ((1, 16), (16, 16), (64, 16), (20, 6), (64, 6), (128, 6), (256, 6), (500, 6))
"""``(B, H)`` of the launch screen: the decode benchmark's and the 340M sweep's batch sizes (6 heads)."""
SCREEN_CONFIGS = ((32, 4), (32, 2), (64, 2), (64, 4), (128, 4), (16, 2))


def _inputs(B, T, H, K, V, dtype, device="cuda"):
    r = lambda *s, dt=dtype: torch.randn(*s, device=device, dtype=dt)  # noqa: E731
    u = lambda *s, dt=dtype: torch.rand(*s, device=device, dtype=dt)  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=0.5 * r(B, T, H, V), g=-0.1 * u(B, T, H, K, dt=torch.float32),
                b=u(B, T, H, K), w=u(B, T, H, V), lam=0.1 * u(H, dt=torch.float32),
                h0=r(B, H, K, V, dt=torch.float32))


def _times(fn):
    """``(do_bench median us, CUDA-graph us per call, host us per call)``."""
    fn()
    torch.cuda.synchronize()
    bench_us = 1e3 * do_bench(fn, warmup=25, rep=200, return_mode="median")
    host = []
    for _ in range(5):  # fewer calls than the launch queue holds: the loop times the host alone
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        host.append(1e6 * (time.perf_counter() - t0) / 100)
    torch.cuda.synchronize()
    try:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn()  # warm the allocator on the capture stream
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(GRAPH_CALLS):
                fn()
        graph_us = 1e3 * do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / GRAPH_CALLS
    except RuntimeError as err:  # a kernel that cannot be captured: report no graph time
        print(f"graph capture failed: {err}", file=sys.stderr)
        graph_us = float("nan")
    return bench_us, graph_us, min(host)


def bench_recurrent(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype = torch.bfloat16,
                    block_config: tuple[int, int] | None = None) -> dict:
    """Microseconds per call of ``T`` tokens (``initial_state`` in, final state out, qk L2-norm in
    kernel), with ``qed_recurrent``'s launch ``block_config`` ``(BV, num_warps)`` (None: its default)."""
    x = _inputs(B, T, H, K, V, dtype)
    args = [x[n] for n in ("q", "k", "v", "g", "b", "w", "lam")]
    kw = dict(arm="full", initial_state=x["h0"], output_final_state=True)
    config = block_config or default_block_config(K, V, torch.float32, B * H)  # the state is float32
    res = {"B": B, "T": T, "H": H, "K": K, "V": V, "dtype": str(dtype).replace("torch.", ""),
           "block_config": config}
    ref = qed_naive(*[a.double() for a in args], **{**kw, "initial_state": x["h0"].double()})[0]
    kw["block_config"] = config
    o = qed_recurrent(*args, **kw)[0]
    res["rel_err_o"] = ((o.double() - ref).norm() / ref.norm()).item()
    for name, probes in (("qed", False), ("qed_probes", True)):
        fn = lambda p=probes: qed_recurrent(*args, **kw, return_probes=p)  # noqa: E731
        res[f"{name}_us"], res[f"{name}_graph_us"], res[f"{name}_host_us"] = _times(fn)
    try:
        from fla.ops.gdn2 import fused_recurrent_gdn2
    except ImportError:
        return res
    fn = lambda: fused_recurrent_gdn2(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"],  # noqa: E731
                                      initial_state=x["h0"], output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    res["fla_us"], res["fla_graph_us"], res["fla_host_us"] = _times(fn)
    res["qed_over_fla"] = res["qed_us"] / res["fla_us"]
    res["qed_over_fla_graph"] = res["qed_graph_us"] / res["fla_graph_us"]
    return res


def bench_decode(B: int, H: int, K: int, V: int, dtype: torch.dtype = torch.bfloat16,
                 block_config: tuple[int, int] | None = None) -> dict:
    """One decode step (T=1) with a carried state: see :func:`bench_recurrent`."""
    return bench_recurrent(B, 1, H, K, V, dtype, block_config)


def screen(K: int = 128, V: int = 128) -> list[dict]:
    """Microseconds per in-place decode step (bf16 inputs, float32 state, CUDA-graph replay of
    :data:`GRAPH_CALLS` steps) per ``(B, H)`` of :data:`SCREEN_SHAPES` and ``(BV, num_warps)`` of :data:`SCREEN_CONFIGS`."""
    rows = []
    for B, H in SCREEN_SHAPES:
        x = _inputs(B, 1, H, K, V, torch.bfloat16)
        args = [x[n] for n in ("q", "k", "v", "g", "b", "w", "lam")]
        us = {}
        for cfg in SCREEN_CONFIGS:
            step = lambda c=cfg: qed_recurrent(*args, initial_state=x["h0"], output_final_state=True,  # noqa: E731
                                               inplace_final_state=True, block_config=c)
            us[str(cfg)] = round(_times(step)[1], 2)
        rows.append(dict(B=B, H=H, K=K, V=V, rule=str(default_block_config(K, V, torch.float32, B * H)), us=us))
        print(f"B{B} H{H}: " + "  ".join(f"{c}={t}" for c, t in us.items()) + f"  (rule {rows[-1]['rule']})",
              flush=True)
    return rows


@contextlib.contextmanager
def stubbed_launches():
    """Inside the block every Triton launch (compiled, or ``TRITON_INTERPRET=1``) is a no-op: the
    Python of a call alone, on any machine."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    launchers = (JITFunction, InterpretedFunction)
    real_runs = [cls.run for cls in launchers]
    for cls in launchers:
        cls.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        for cls, run in zip(launchers, real_runs):
            cls.run = run


def _host_us(fn, calls: int) -> float:
    """Microseconds per call of ``fn``: the median of 7 loops of ``calls`` calls, after one call."""
    fn()
    loops = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append(1e6 * (time.perf_counter() - t0) / calls)
    return round(sorted(loops)[3], 2)


def host_paths(B: int = 16, H: int = 16, K: int = 128, V: int = 128, calls: int = 2000) -> dict:
    """Microseconds per call of ``qed_recurrent`` and fla's ``fused_recurrent_gdn2`` (if installed)
    on CPU tensors with Triton's launch stubbed out (:func:`stubbed_launches`)."""
    with stubbed_launches():
        x = _inputs(B, 1, H, K, V, torch.bfloat16, device="cpu")
        fns = {"qed_host_us": lambda: qed_recurrent(*[x[n] for n in ("q", "k", "v", "g", "b", "w", "lam")],
                                                    initial_state=x["h0"], output_final_state=True)}
        try:
            from fla.ops.gdn2 import fused_recurrent_gdn2
            fns["fla_host_us"] = lambda: fused_recurrent_gdn2(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"],
                                                              initial_state=x["h0"], output_final_state=True,
                                                              use_qk_l2norm_in_kernel=True)
        except ImportError:
            pass
        return {"B": B, "H": H, "K": K, "V": V, **{name: _host_us(fn, calls) for name, fn in fns.items()}}


def hf_layer_host_paths(B: int = 8, H: int = 16, HV: int = 16, K: int = 128, calls: int = 2000) -> dict:
    """Microseconds per decode call of a Qwen3.5-shaped layer's recurrence (``H`` q/k heads, ``HV``
    value heads, ``K = V``) with Triton's launch stubbed out, on CPU tensors handed over as
    transformers hands them (q, k, v strided views of the convolution's output, ``g`` float32 and
    ``beta`` bf16 ``[B, 1, HV]``, the cached float32 state): ``qedprobe.hf``'s recurrence with
    QED injected (lam 0.1, arm full) and ``hook_e``, ``hook_Sd`` hooked (the benchmark's hooked
    decode step), and fla's ``fused_recurrent_gated_delta_rule``, which the native model calls."""
    from qedprobe.hf.families import HFQEDConfig
    from qedprobe.hf.recurrence import LinearAttnRecurrence
    from qedprobe.model import LambdaScale
    cfg = HFQEDConfig(model_type="qwen3_5_text", vocab_size=1, hidden_size=1, num_hidden_layers=1, linear_layers=(0,),
                      num_heads=HV, num_key_heads=H, head_dim=K, head_v_dim=K, arm="full", lam=((0.1,) * HV,),
                      op_mode="recurrent")
    layer = LinearAttnRecurrence(cfg, 0, LambdaScale)
    for hook in (layer.hook_e, layer.hook_Sd):
        hook.add_hook(lambda act, hook: None)
    qkv = torch.randn(B, 1, (2 * H + HV) * K, dtype=torch.bfloat16)
    q, k, v = (x.view(B, 1, -1, K) for x in torch.split(qkv, [H * K, H * K, HV * K], dim=-1))
    g, beta = -torch.rand(B, 1, HV), torch.rand(B, 1, HV, dtype=torch.bfloat16)
    state = torch.randn(B, HV, K, K)
    args = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    fns = {"qed_hf_layer_host_us": lambda: layer.recurrence(q, k, v, g, beta, phase="decode", **args)}
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        fns["fla_gdn_host_us"] = lambda: fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **args)
    except ImportError:
        pass
    with stubbed_launches():
        return {"B": B, "H": H, "HV": HV, "K": K, **{name: _host_us(fn, calls) for name, fn in fns.items()}}


def _closure_cell(fn, name: str):
    """The cell of ``fn``'s free variable ``name``."""
    try:
        return fn.__closure__[fn.__code__.co_freevars.index(name)]
    except (AttributeError, TypeError, ValueError):
        raise RuntimeError(f"recurrent_decode: {fn!r} has no closure variable {name!r} (another "
                           f"transformers version?)") from None


@contextlib.contextmanager
def fla_on_cpu(fn):
    """Inside the block transformers' recurrence function ``fn`` of a modeling module (through
    qedprobe's route where one is installed) hands CPU tensors to fla, as it hands CUDA tensors on
    a GPU, instead of to its PyTorch code: the native layer's decode path with its host side as on
    a GPU (for :func:`stubbed_launches`)."""
    fn = getattr(fn, "original", fn)  # below a qedprobe.hf route
    if isinstance(fn, torch.nn.Module):  # kernels' module around the function, where it is installed
        fn = _closure_cell(type(fn).forward, "func").cell_contents
    cell = _closure_cell(fn, "supported_devices")
    devices = cell.cell_contents
    cell.cell_contents = (*devices, "cpu")
    try:
        yield
    finally:
        cell.cell_contents = devices


def hf_decoder_layer_host_paths(B: int = 8, HV: int = 16, calls: int = 200, rounds: int = 10) -> dict:
    """Microseconds per decode step of one whole Gated DeltaNet layer (transformers' module:
    projections, convolution with its cached state, gates, recurrence, cache update, gated norm,
    output projection) of ``hf_models.qwen35_config(HV, small=True)``'s model (bf16, batch ``B``, a cache
    filled by an 8-token prefill), for each of ``hf_models.DECODE_VARIANTS``: native, adapted
    with nothing hooked, injected with ``hook_e`` and ``hook_Sd`` hooked. Triton's launches are
    stubbed out (:func:`stubbed_launches`), the native recurrence goes to fla as on a GPU
    (:func:`fla_on_cpu`) and the injected one to ``qed_recurrent`` (op mode ``recurrent``); the
    tensors are tiny, so the variants differ by their Python. Each figure is the median over
    ``rounds`` alternating rounds (``hf_models.interleaved_decode``, one thread) of
    :func:`_host_us` over ``calls`` steps."""
    import hf_models
    from qedprobe.hf import route
    from qedprobe.hf.families import modeling_module_name, routed_functions
    model = hf_models.random_qwen35(HV, small=True, device="cpu")
    cfg, routed = model.config, routed_functions(model.config.model_type)
    module_name = modeling_module_name(cfg.model_type)
    route.install(module_name, routed)  # the native model runs through the route, as after any adaptation
    decode_fn = getattr(sys.modules[module_name], next(name for name, phase in routed.items() if phase == "decode"))
    layer = model.model.layers[cfg.layer_types.index("linear_attention")].linear_attn
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad(), stubbed_launches(), fla_on_cpu(decode_fn):
            cache = model(torch.randint(2, cfg.vocab_size, (B, 8)), use_cache=True).cache
            x = torch.randn(B, 1, cfg.hidden_size, dtype=torch.bfloat16)
            step = lambda: layer(hidden_states=x, cache=cache, attention_mask=None, use_cache=True)  # noqa: E731
            per_round = hf_models.interleaved_decode(model, lambda: [_host_us(step, calls)], rounds,
                                                     op_mode="recurrent", unit="us")
    finally:
        torch.set_num_threads(threads)
    return {"B": B, "H": cfg.linear_num_key_heads, "HV": cfg.linear_num_value_heads, "K": cfg.linear_key_head_dim,
            "layer_step_us": {name: statistics.median(us) for name, us in per_round.items()}}


def main() -> int:
    if "--host-only" in sys.argv[1:]:
        print(json.dumps(host_paths()))
        print(json.dumps(hf_layer_host_paths()))
        print(json.dumps(hf_decoder_layer_host_paths()))
        return 0
    if not torch.cuda.is_available():
        print("recurrent_decode: needs CUDA", file=sys.stderr)
        return 1
    out = os.environ.get("OUT")
    if "--screen" in sys.argv[1:]:
        rows = screen()
        if out:
            with open(os.path.join(out, "decode_screen.json"), "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        return 0
    rows = [bench_decode(16, 16, 128, 128, torch.bfloat16), bench_decode(16, 16, 64, 64, torch.bfloat16),
            bench_decode(1, 16, 128, 128, torch.bfloat16), bench_decode(64, 16, 128, 128, torch.bfloat16),
            bench_recurrent(2, 1024, 16, 128, 128, torch.bfloat16)]
    # Sweep the launch configuration (BV, num_warps) on the benchmark shape and at B=64.
    for cfg in [(16, 4), (32, 8), (64, 8)]:
        rows += [bench_decode(16, 16, 128, 128, torch.bfloat16, cfg), bench_decode(64, 16, 128, 128, torch.bfloat16, cfg)]
    if out:
        with open(os.path.join(out, "recurrent_decode.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    cols = ["B", "T", "K", "block_config", "rel_err_o", "qed_us", "qed_probes_us", "fla_us",
            "qed_graph_us", "qed_probes_graph_us", "fla_graph_us", "qed_host_us", "fla_host_us"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
