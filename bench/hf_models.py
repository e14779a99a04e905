"""Real-model recurrence benchmark: the QED op on the gates models have, against their native kernels.

CUDA only; not a test.

    PYTHONUNBUFFERED=1 python3 bench/hf_models.py [--json PATH] [--commit SHA] [--sections op,decoder,...]
        [--budget S] [--value-heads 16,32] [--op-shapes 1x32768,8x4096]

Everything is timed in one process on one card (median of ``triton.testing.do_bench``; peak GPU
memory of one call, inputs included, from ``torch.cuda.max_memory_allocated``); bf16 ``q, k, v``,
float32 log-decay ``-0.1 U(0, 1)``, ``beta ~ U(0, 1)`` in bf16, qk L2-norm in the kernel.

* ``op``: Qwen3.5-style Gated DeltaNet layers (16 q/k heads x 128, 16 / 32 / 64 value heads,
  K = V = 128) at 1 x 32K and 8 x 4K tokens: ``qed_chunk`` with per-head gates ``g, b = w = beta``
  ``[B, T, HV]``, arm full, lam 0.1, probes off, all four and ``("e", "Sd")`` (what a hooked
  layer with ``hook_e`` and ``hook_Sd`` asks for), against fla 0.6.0's
  ``chunk_gated_delta_rule`` (its Triton kernels; with FlashQLA installed fla routes there and the
  rows say so) and, where importable, FlashQLA's own op.
* ``kda``: Kimi-Linear's layer shape (32 heads x 128, per-channel decay ``[B, T, HV, K]``,
  ``b = w = beta`` ``[B, T, HV]``) against fla's ``chunk_kda``.
* ``decode``: one token with a carried state (B = 8, 16 q/k heads, 32 value heads):
  ``qed_recurrent`` against fla's ``fused_recurrent_gated_delta_rule``, eager and CUDA-graph replay.
* ``parts``: per-kernel device times (torch.profiler, ms per call) of ``qed_chunk`` (probes off
  and on) and fla's ``chunk_gated_delta_rule`` at 1 x 32K and 8 x 4K with each ``--value-heads``
  count.
* ``decoder``: a random Qwen3.5-shaped model adapted with ``qedprobe.hf`` (nothing hooked; QED
  injected with ``hook_e`` and ``hook_Sd`` hooked) against the native model: prefill at 32K and
  128K with peak memory, and the decode steps inside ``generate`` (B = 8 prompts of 8K, 16 steps,
  each timed by a stopping criterion that reads a synchronised clock after every token). A decode
  step of this model is bound by the host's launches (about 5 ms of GPU work in 30 ms), whose
  speed drifts between runs by more than the targets' margins, so the three variants are
  measured in eight alternating rounds (the model adapted and detached again in each): each row's
  ``ms`` is the median of its rounds' medians and its ratio the median over rounds of its round's
  median over native's in the same round, so that a drift between rounds cancels (each round's
  median, minimum and maximum per variant printed to the log, so that a disturbed round shows).
* ``generate``: the ``decoder`` section's decode-step rows alone, without its prefill rows, in
  ``--rounds`` rounds a model (8 by default); a value-head count named twice (``--value-heads
  16,32,32,16``) pools both models' rounds.
* ``decode_parts``: the same models' decode step outside ``generate`` (a prefill with a cache,
  then 16 forwards of one token each: ``generate``'s loop without its bookkeeping), the variants
  alternated as above; printed to the log, the host synchronisations one run of each makes and
  the lines that waited (torch's sync debug mode) and a torch.profiler table of the native and
  the injected, hooked steps (a step's kernel launches, aten ops and op CPU time; the top ops by
  CUDA time and by CPU time): where a hooked decode step's time goes.

Rows ``name, shape, ms, native_ms, ratio, peak_gb, native_peak_gb`` plus ``device, date,
commit`` go to ``--json`` (default ``$OUT/hf_models.json`` when ``$OUT`` is set, else
``docs/benchmarks/hf_models.json``), rewritten after each row; a markdown table is printed last.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import itertools
import json
import os
import statistics
import sys
import time
import warnings

import torch
from triton.testing import do_bench

from qedprobe.kernels.qed import qed_chunk, qed_recurrent

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder's modules, also under ``python -P``
from kernel_times import kernel_ms  # noqa: E402
from layer_inputs import head_gate_inputs  # noqa: E402

DEV = "cuda"
OP_SHAPES = [(1, 32768), (8, 4096)]
QK_HEADS, HEAD_DIM = 16, 128
VALUE_HEADS = (16, 32, 64)
KDA_HEADS = 32
DECODE = dict(B=8, H=16, HV=32)
SECTIONS = ("op", "kda", "decode", "decoder", "generate", "parts", "decode_parts")


def P(*a):
    print(*a, flush=True)


def shape_of(x) -> str:
    B, T, H, K = x["q"].shape
    return f"B{B} T{T} H{H} HV{x['v'].shape[2]} K{K}"


def measure(fn) -> tuple[float, float]:
    """``(ms, peak_gb)``: median time of ``fn`` and the peak memory of one call (inputs included)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    return do_bench(fn, warmup=10, rep=60, return_mode="median"), peak


class Rows:
    """The benchmark's rows, written to ``path`` after each one (a cut run keeps what it has)."""

    def __init__(self, path: str, commit: str):
        self.path, self.rows = path, []
        self.meta = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=commit)

    def add(self, name, shape, got, native=None, ratio=None):
        """``got``, ``native``: ``(ms, peak GB or None)``; ``ratio``: the row's ratio where it is not
        ``ms / native ms`` (the decode rows' paired per-round ratio)."""
        (t, peak), (nt, npeak) = got, native or (None, None)
        ratio = ratio if ratio is not None else (t / nt if nt else None)
        r = dict(name=name, shape=shape, ms=round(t, 4), native_ms=round(nt, 4) if nt else None,
                 ratio=round(ratio, 4) if ratio is not None else None,
                 peak_gb=round(peak, 3) if peak is not None else None,
                 native_peak_gb=round(npeak, 3) if npeak is not None else None, **self.meta)
        self.rows.append(r)
        P(f"{name:48s} {shape:26s} {t:8.3f} ms" + (f"  native {nt:8.3f}  ratio {r['ratio']:.3f}" if nt else ""))
        if os.path.dirname(self.path):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self.rows, f, indent=1)

    def table(self) -> str:
        lines = [f"device: {self.meta['device']}, torch {torch.__version__}, commit {self.meta['commit']}", "",
                 "| row | shape | ms | native ms | ratio | peak GB | native peak GB |", "|---|---|---|---|---|---|---|"]
        fmt = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
        for r in self.rows:
            lines.append(f"| {r['name']} | {r['shape']} | {fmt(r['ms'])} | {fmt(r['native_ms'])} | "
                         f"{fmt(r['ratio'])} | {fmt(r['peak_gb'], 2)} | {fmt(r['native_peak_gb'], 2)} |")
        return "\n".join(lines)


def qed_fn(x, probes=False, recurrent=False, state=None):
    op = qed_recurrent if recurrent else qed_chunk
    return lambda: op(x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"], x["lam"], arm="full",
                      return_probes=probes, initial_state=state, output_final_state=state is not None)


def native_fn(op, x):
    """fla's ``op(q, k, v, g, beta)`` on ``x``, qk L2-norm in the kernel."""
    return functools.partial(op, x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True)


def native_gdn():
    """fla's ``chunk_gated_delta_rule`` and a label saying which backend it runs."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    try:
        import flash_qla  # noqa: F401
        label = "fla chunk_gated_delta_rule (routed to FlashQLA)"
    except ImportError:
        label = "fla chunk_gated_delta_rule"
    return chunk_gated_delta_rule, label


def flash_qla_gdn():
    """FlashQLA's own ``chunk_gated_delta_rule`` (fla's arguments), or None where it is not installed."""
    try:
        from flash_qla import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def op_rows(rows: Rows, left, shapes=OP_SHAPES):
    fla_op, label = native_gdn()
    fq_op = flash_qla_gdn()
    for B, T in shapes:
        for HV in VALUE_HEADS:
            if left() < 20:
                P("budget: op rows cut")
                return
            x = head_gate_inputs(B, T, QK_HEADS, HV, HEAD_DIM, device=DEV)
            native = measure(native_fn(fla_op, x))
            rows.add(label, shape_of(x), native)
            qed = measure(qed_fn(x))
            rows.add("qed_chunk full, per-head gates", shape_of(x), qed, native)
            if fq_op is not None:
                flash_qla = measure(native_fn(fq_op, x))
                rows.add("FlashQLA chunk_gated_delta_rule", shape_of(x), flash_qla)
                rows.add("qed_chunk full, per-head gates, against FlashQLA", shape_of(x), qed, flash_qla)
            rows.add("qed_chunk full, per-head gates + probes", shape_of(x), measure(qed_fn(x, probes=True)), native)
            rows.add("qed_chunk full, per-head gates + probes e, Sd", shape_of(x),
                     measure(qed_fn(x, probes=("e", "Sd"))), native)
            del x
            torch.cuda.empty_cache()


def kda_rows(rows: Rows, left, shapes=OP_SHAPES):
    from fla.ops.kda import chunk_kda
    for B, T in shapes:
        if left() < 20:
            return
        x = head_gate_inputs(B, T, KDA_HEADS, KDA_HEADS, HEAD_DIM, device=DEV, channel_g=True)
        native = measure(native_fn(chunk_kda, x))
        rows.add("fla chunk_kda", shape_of(x), native)
        rows.add("qed_chunk full, KDA gates", shape_of(x), measure(qed_fn(x)), native)
        rows.add("qed_chunk full, KDA gates + probes", shape_of(x), measure(qed_fn(x, probes=True)), native)
        del x
        torch.cuda.empty_cache()


def graph_ms(fn) -> float:
    """Median time of one CUDA-graph replay of ``fn`` (the GPU alone, no host launch cost)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=10, rep=60, return_mode="median")


def decode_rows(rows: Rows, left):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    x = head_gate_inputs(DECODE["B"], 1, DECODE["H"], DECODE["HV"], HEAD_DIM, device=DEV)
    state = torch.zeros(DECODE["B"], DECODE["HV"], HEAD_DIM, HEAD_DIM, device=DEV)
    fla_fn = lambda: fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],  # noqa: E731
                                                        initial_state=state, output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True)
    qed = qed_fn(x, recurrent=True, state=state)
    native = measure(fla_fn)
    rows.add("fla fused_recurrent_gated_delta_rule", shape_of(x), native)
    rows.add("qed_recurrent full, per-head gates", shape_of(x), measure(qed), native)
    n_graph = graph_ms(fla_fn)
    rows.add("fla fused_recurrent_gated_delta_rule, CUDA graph", shape_of(x), (n_graph, None))
    rows.add("qed_recurrent, CUDA graph", shape_of(x), (graph_ms(qed), None), (n_graph, None))


def parts_rows(rows: Rows, left, value_heads=(32,), shapes=OP_SHAPES):
    fla_op, label = native_gdn()
    for HV, (B, T) in itertools.product(value_heads, shapes):
        if left() < 20:
            P("budget: parts rows cut")
            return
        x = head_gate_inputs(B, T, QK_HEADS, HV, HEAD_DIM, device=DEV)
        for name, fn in (("qed", qed_fn(x)), ("qed+probes", qed_fn(x, probes=True)), ("fla", native_fn(fla_op, x))):
            fn()  # compiled and autotuned before the profile
            for key, t_ms in kernel_ms(fn).items():
                rows.add(f"  {name}: {key[:44]}", shape_of(x), (t_ms, None))
        del x
        torch.cuda.empty_cache()


DECODER_LENGTHS = (32768, 131072)
DECODER_VALUE_HEADS = (16, 32)
"""Value heads of the Qwen3.5-shaped models (0.8B's 16; 4B / 9B's 32), ``--value-heads``."""
GENERATE = dict(B=8, T=8192, steps=16)
DECODE_ROUNDS = 8
"""Alternating rounds of the decode variants per model, by default (``--rounds``)."""


def qwen35_config(HV: int, small: bool):
    """Qwen3.5-0.8B's text shape with random weights (24 layers: 18 Gated DeltaNet layers of 16
    q/k heads x 128 and ``HV`` value heads of 128, 6 full-attention layers), or a tiny one."""
    from transformers import Qwen3_5TextConfig
    if small:
        return Qwen3_5TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                 linear_num_value_heads=HV // 8, linear_key_head_dim=16, linear_value_head_dim=16)
    return Qwen3_5TextConfig(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                             linear_num_value_heads=HV, linear_key_head_dim=128, linear_value_head_dim=128)


def random_qwen35(HV: int, small: bool, device: str | None = None):
    """:func:`qwen35_config`'s model with random weights (seed 0), bf16, on ``device`` (default
    :data:`DEV`), in eval mode."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(qwen35_config(HV, small)).to(device or DEV, torch.bfloat16).eval()


PROBE_HOOKS = [(lambda name: name.endswith(("hook_e", "hook_Sd")), lambda act, hook: None)]
"""What the hooked rows record: ``hook_e`` and ``hook_Sd`` of every layer (the hook keeps nothing)."""


def generate_batch(small: bool) -> tuple[int, int]:
    """``(B, T)`` of the decode rows' prompts: :data:`GENERATE`'s, or a tiny one."""
    return (2, 64) if small else (GENERATE["B"], GENERATE["T"])


def timed(fn, repeat: int = 3) -> tuple[float, float]:
    """``(ms, peak_gb)``: median wall time of ``repeat`` synchronised calls after one warm-up (the
    decoder's calls take up to seconds, so the host clock is exact enough), and the peak memory."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated() / 2 ** 30


class StepClock:
    """A ``generate`` stopping criterion that stops nothing and reads a synchronised clock after
    every token: the differences of its ``stamps`` are the decode steps as ``generate`` runs them
    (its own loop already waits for the GPU once a step, to test whether every sequence ended)."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores, **kwargs):
        torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def steps_ms(self) -> list[float]:
        return [1e3 * (b - a) for a, b in zip(self.stamps, self.stamps[1:])]


def generate_steps(hf_model, ids):
    """``measure() -> [ms]``: each decode step of one ``hf_model.generate`` call on ``ids`` that
    makes ``1 + GENERATE["steps"]`` tokens (greedy), timed inside ``generate`` by a
    :class:`StepClock` (the prefill and its first token are not a step)."""
    from transformers import StoppingCriteriaList

    def measure() -> list[float]:
        clock = StepClock()
        n = 1 + GENERATE["steps"]
        hf_model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                          stopping_criteria=StoppingCriteriaList([clock]))
        return clock.steps_ms()
    return measure


def cached_decode(model, ids, steps: int):
    """``run(profiler=None) -> [ms]``: a prefill of ``ids`` with a cache, then ``steps`` forwards of
    one greedy token each with the cache; ms per decode forward (the prefill untimed), the decode
    part inside ``profiler`` when one is given."""
    def run(profiler=None) -> list[float]:
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profiler or contextlib.nullcontext():
            for _ in range(steps):
                out = model(tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
        return [1e3 * (time.perf_counter() - t0) / steps]
    return run


@contextlib.contextmanager
def native(model, op_mode: str = "auto"):
    """``model`` as it is (``op_mode`` unused): transformers' own recurrence functions."""
    yield


@contextlib.contextmanager
def adapted_unhooked(model, op_mode: str = "auto"):
    """Inside the block ``model`` is adapted by ``qedprobe.hf`` (with ``op_mode``) with nothing
    hooked or injected (it calls its own recurrence functions); native again after it."""
    from qedprobe.hf import adapt
    adapted = adapt(model, op_mode=op_mode)
    try:
        yield
    finally:
        adapted.detach()


@contextlib.contextmanager
def injected_and_hooked(model, op_mode: str = "auto"):
    """Inside the block ``model`` is adapted (with ``op_mode``) with QED injected (lambda 0.1, arm
    ``full``) and :data:`PROBE_HOOKS` attached; native again after it."""
    from qedprobe.hf import adapt, inject_qed
    adapted = inject_qed(adapt(model, op_mode=op_mode), 0.1, arm="full")
    try:
        with adapted.hooks(fwd_hooks=PROBE_HOOKS):
            yield
    finally:
        adapted.detach()


DECODE_VARIANTS = {"native": native, "adapted, nothing hooked": adapted_unhooked,
                   "injected, hook_e + hook_Sd": injected_and_hooked}
"""The decode rows' variants: name -> ``context(model, op_mode="auto")`` inside which the model is
that variant (adapted with that op mode)."""


def interleaved_decode(model, measure, rounds: int = DECODE_ROUNDS, op_mode: str = "auto",
                       unit: str = "ms") -> dict[str, list]:
    """``{variant: [median of measure() in each round]}`` (``measure()``: a list of step times in
    ``unit``) inside each of :data:`DECODE_VARIANTS` of ``model`` (adapted with ``op_mode``), in
    turn in each of ``rounds`` rounds (after one round of warm-up, not returned): the host's
    drifts, which move a launch-bound decode step by more than the targets' margins within a run,
    then fall on the variants of one round alike, and :func:`decode_rows_of` compares them round
    by round. Each round's median, minimum and maximum per variant is logged."""
    got = {name: [] for name in DECODE_VARIANTS}
    for r in range(1 + rounds):
        for name, variant in DECODE_VARIANTS.items():
            with variant(model, op_mode=op_mode):
                times = measure()
            P(f"decode round {r}{' (warm-up)' if r == 0 else ''}, {name}: "
              f"median {statistics.median(times):.3f} {unit}, min {min(times):.3f}, max {max(times):.3f}, "
              f"{len(times)} steps")
            if r:
                got[name].append(statistics.median(times))
    return got


def decode_rows_of(rows: Rows, label: str, shape: str, rounds: dict[str, list]) -> None:
    """One row per :data:`DECODE_VARIANTS` entry of ``rounds`` (:func:`interleaved_decode`'s round
    medians): ``ms`` the median of its rounds, ``ratio`` the median over rounds of its round's
    figure over native's in the same round (paired: a drift between rounds cancels)."""
    native = rounds["native"]
    native_ms = statistics.median(native)
    for name in DECODE_VARIANTS:
        ms = statistics.median(rounds[name])
        if name == "native":
            rows.add(f"{label} ({name})", shape, (ms, None))
            continue
        paired = statistics.median(t / n for t, n in zip(rounds[name], native, strict=True))
        rows.add(f"{label} ({name})", shape, (ms, None), (native_ms, None), ratio=paired)


KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
"""The profiler's names of the CUDA runtime / driver calls that launch a kernel (torch's own, Triton's)."""


def step_counts(averages, steps: int) -> dict[str, float]:
    """``{"launches", "aten_ops", "op_cpu_ms"}`` per step from a profile's ``key_averages()`` over
    ``steps`` steps: kernel launches, aten ops, and the CPU time the profiler attributes to ops. A
    launch-bound step that makes the same launches and spends no more op CPU time than another,
    yet takes longer, spends the difference in Python outside torch's ops."""
    return dict(launches=sum(e.count for e in averages if e.key in KERNEL_LAUNCHES) / steps,
                aten_ops=sum(e.count for e in averages if e.key.startswith("aten::")) / steps,
                op_cpu_ms=sum(e.self_cpu_time_total for e in averages) / 1e3 / steps)


def profile_table(run, label: str, steps: int) -> None:
    """Print :func:`step_counts` and the top ops of one ``run`` (``steps`` decode steps) by self
    CUDA time and by CPU time (the log, not the rows)."""
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    run(prof)
    counts = step_counts(prof.key_averages(), steps)
    P(f"--- {label}: a step makes {counts['launches']:.0f} kernel launches and {counts['aten_ops']:.0f} aten ops, "
      f"{counts['op_cpu_ms']:.2f} ms of op CPU time under the profiler")
    for key in ("self_cuda_time_total", "cpu_time_total"):
        P(f"--- {label}: top ops by {key}")
        P(prof.key_averages().table(sort_by=key, row_limit=10, max_name_column_width=60))


def decoder_shape(rows: Rows, HV: int, small: bool, left):
    """Native, adapted (nothing hooked), and injected with ``hook_e`` / ``hook_Sd`` hooked:
    prefill at each length of :data:`DECODER_LENGTHS`, then the decode steps inside ``generate``
    (:func:`interleaved_decode`)."""
    model = random_qwen35(HV, small)
    vocab = model.config.vocab_size
    lengths = (256,) if small else DECODER_LENGTHS
    prompts = {T: torch.randint(2, vocab, (1, T), device=DEV) for T in lengths}
    prefill = lambda ids: lambda: model(ids, use_cache=False, logits_to_keep=1)  # noqa: E731
    native = {T: timed(prefill(ids)) for T, ids in prompts.items() if left() > 60}
    with adapted_unhooked(model):
        for T, ids in prompts.items():
            if T in native:
                rows.add("native prefill (transformers + fla)", f"B1 T{T} HV{HV}", native[T])
                rows.add("adapted prefill, nothing hooked", f"B1 T{T} HV{HV}", timed(prefill(ids)), native[T])
    with injected_and_hooked(model):
        for T, ids in prompts.items():
            if T in native:
                rows.add("injected prefill, hook_e + hook_Sd", f"B1 T{T} HV{HV}", timed(prefill(ids)), native[T])
    generate_decode(rows, model, HV, small)


def generate_decode(rows: Rows, model, HV: int, small: bool) -> None:
    """The decode-step rows of ``model`` (``HV`` value heads): :func:`generate_rounds`."""
    decode_rows_of(rows, GENERATE_LABEL, generate_shape(HV, small), generate_rounds(model, small))


GENERATE_LABEL = "decode step in generate"


def generate_shape(HV: int, small: bool) -> str:
    B, Tg = generate_batch(small)
    return f"B{B} T{Tg} HV{HV} decode"


def generate_rounds(model, small: bool, rounds: int = DECODE_ROUNDS) -> dict[str, list]:
    """:func:`interleaved_decode`'s medians of ``rounds`` rounds of the steps inside ``generate`` on
    a batch of random prompts (:func:`generate_batch`)."""
    B, Tg = generate_batch(small)
    gen_ids = torch.randint(2, model.config.vocab_size, (B, Tg), device=DEV)
    return interleaved_decode(model, generate_steps(model, gen_ids), rounds=rounds)


def host_synchronisations(run) -> collections.Counter:
    """Where one ``run()`` waits for the GPU as torch's sync debug mode reports it (a ``.item()``,
    a device-to-host copy; ``run``'s own two ``torch.cuda.synchronize`` are the same in every
    variant): ``{"file:line": count}`` of the Python lines that waited. A wait inside a
    launch-bound step stalls the host's queue."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower())


def decode_parts_rows(rows: Rows, left, small: bool = False, value_heads=DECODER_VALUE_HEADS):
    B, Tg = generate_batch(small)

    def one_model(HV: int) -> None:
        model = random_qwen35(HV, small)
        ids = torch.randint(2, model.config.vocab_size, (B, Tg), device=DEV)
        run = cached_decode(model, ids, GENERATE["steps"])
        decode_rows_of(rows, "decode forward (cache)", f"B{B} T{Tg} HV{HV} decode", interleaved_decode(model, run))
        for name in ("native", "injected, hook_e + hook_Sd"):
            with DECODE_VARIANTS[name](model):
                waits = host_synchronisations(run)
                P(f"host synchronisations in one run, {name}, {HV} value heads: {sum(waits.values())}, "
                  f"at {waits.most_common(5)}")
                profile_table(run, f"{name}, {HV} value heads", GENERATE["steps"])
    each_model("decode_parts", value_heads, left, 60, one_model)


def each_model(section: str, value_heads, left, needs_s: float, run) -> None:
    """``run(HV)`` without autograd for each value-head count while the budget ``left()`` has
    ``needs_s`` seconds for one more (else the section's rows are cut, said in the log), the
    CUDA cache emptied after each model."""
    for HV in value_heads:
        if left() < needs_s:
            P(f"budget: {section} rows cut")
            return
        with torch.no_grad():
            run(HV)
        torch.cuda.empty_cache()


def decoder_rows(rows: Rows, left, small: bool = False, value_heads=DECODER_VALUE_HEADS):
    each_model("decoder", value_heads, left, 120, lambda HV: decoder_shape(rows, HV, small, left))


def generate_rows(rows: Rows, left, small: bool = False, value_heads=DECODER_VALUE_HEADS, rounds: int = DECODE_ROUNDS):
    """The ``decoder`` section's decode-step rows alone (no prefill rows), ``rounds`` rounds a
    model (:func:`interleaved_decode`). A value-head count
    named more than once (``16,32,32,16``: each model built twice, the second time in the opposite
    order, so that a drift of the host over the run touches both counts alike) pools the rounds of
    its models into one row per variant, written after its last model (or, where the budget cuts
    the section, after the last one that ran)."""
    pending = collections.Counter(value_heads)
    pooled: dict[int, dict[str, list]] = {}

    def one_model(HV: int) -> None:
        for name, got in generate_rounds(random_qwen35(HV, small), small, rounds).items():
            pooled.setdefault(HV, {}).setdefault(name, []).extend(got)
        pending[HV] -= 1
        if not pending[HV]:
            decode_rows_of(rows, GENERATE_LABEL, generate_shape(HV, small), pooled.pop(HV))

    each_model("generate", value_heads, left, 60, one_model)
    for HV, rounds in pooled.items():
        decode_rows_of(rows, GENERATE_LABEL, generate_shape(HV, small), rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    out = os.environ.get("OUT")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--json", default=os.path.join(out, "hf_models.json") if out else
                    os.path.join(os.path.dirname(here), "docs", "benchmarks", "hf_models.json"))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"), help="commit the kernels are from")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {SECTIONS}")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; later rows are cut after")
    ap.add_argument("--value-heads", default=",".join(map(str, DECODER_VALUE_HEADS)),
                    help="comma-separated value-head counts of the parts rows and the decoder, generate and "
                         "decode_parts models")
    ap.add_argument("--rounds", type=int, default=DECODE_ROUNDS,
                    help="alternating rounds of the generate section's variants per model (at least 1)")
    ap.add_argument("--op-shapes", default=",".join(f"{b}x{t}" for b, t in OP_SHAPES),
                    help="comma-separated BxT token shapes of the op, kda and parts rows")
    a = ap.parse_args()
    sections = a.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"--sections: unknown {sorted(unknown)}; expected some of {SECTIONS}")
    try:
        value_heads = tuple(int(x) for x in a.value_heads.split(","))
    except ValueError:
        ap.error(f"--value-heads: expected comma-separated integers such as 16,32, got {a.value_heads!r}")
    if any(h % QK_HEADS for h in value_heads):
        ap.error(f"--value-heads: each must be a multiple of the {QK_HEADS} q/k heads, got {a.value_heads!r}")
    try:
        shapes = [tuple(int(n) for n in s.split("x")) for s in a.op_shapes.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        ap.error(f"--op-shapes: expected comma-separated BxT such as 1x32768,8x4096, got {a.op_shapes!r}")
    if a.rounds < 1:
        ap.error(f"--rounds: expected a positive integer, got {str(a.rounds)!r}")
    if not torch.cuda.is_available():
        P("bench/hf_models.py needs CUDA")
        return 1
    start = time.time()
    left = lambda: a.budget - (time.time() - start)  # noqa: E731
    rows = Rows(a.json, a.commit)
    runners = dict(op=op_rows, kda=kda_rows, decode=decode_rows, decoder=decoder_rows, generate=generate_rows,
                   parts=parts_rows, decode_parts=decode_parts_rows)
    options = dict(op=dict(shapes=shapes), kda=dict(shapes=shapes), parts=dict(value_heads=value_heads, shapes=shapes),
                   decoder=dict(value_heads=value_heads), generate=dict(value_heads=value_heads, rounds=a.rounds),
                   decode_parts=dict(value_heads=value_heads))
    for name in sections:
        runners[name](rows, left, **options.get(name, {}))
    P(rows.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
