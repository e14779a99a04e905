"""Kernel benchmark: qed_chunk and qed_recurrent against fla 0.6.0 in one process.

CUDA only; not a test.

    PYTHONUNBUFFERED=1 python3 bench/kernel_times.py [--json PATH] [--commit SHA] [--budget S] [--quick] [--parts] [--dplr]
        [--no-fla [--fla-ms MS] [--fla-fwd-bwd-ms MS]]

Rows, in this order (median of ``triton.testing.do_bench``; bf16 q/k/v/b/w, float32 log-decay
``-0.1 U(0,1)``, per-head lam 0.1, qk L2-norm in the kernel; main shape B=8, T=4096, H=16,
K=V=128):

1. fla ``chunk_gdn2`` forward + backward first (its first backward call autotunes for minutes
   on an H200), then its forward;
2. ``qed_chunk`` forward (arm full) fresh, i.e. before any other qed shape ran in the process,
   with probes off and on;
3. the order-independence check: forwards on smaller shapes (B=2, H=4, T=600..4096), then the
   main-shape forward again: ratio to the fresh time;
4. ``qed_chunk`` forward + backward (``torch.autograd.grad`` of ``o`` w.r.t. q, k, v, g, b, w,
   lam) against fla's measured in step 1;
5. one decode token (``qed_recurrent``, B=16) against fla ``fused_recurrent_gdn2``
   (``bench/recurrent_decode.py``): ``do_bench`` of an eager call (bound by the host at this
   size), the CUDA-graph replay (the GPU alone) and the host's Python time per call;
6. T = 1K .. 32K at B*T = 32K tokens, qed (probes off / on) and fla side by side;
7. every arm, probes off and on;
8. grouped value heads (H=16 q/k heads, HV=32 value heads, T=4096, B=4) against fla.

Steps 4-8 each start only while ``--budget`` leaves time for them; the rows that carry targets come
first.

``--quick`` stops after step 3 and the forward + backward of step 4; ``--parts`` adds per-kernel
rows (torch.profiler, ms per call) for the main shape: the ``qed_*`` kernels of the forward
(probes off and on), every kernel of the forward + backward (torch's too: the backward's zeros,
sums and casts count) and, with fla, every kernel of fla's forward. ``--no-fla`` leaves fla out (its autotune
takes minutes; for comparing kernel versions in one call), the ratios then against ``--fla-ms``
and ``--fla-fwd-bwd-ms`` when given (fla's times measured before on the same machine kind). The rows (``name, shape, ms, ref_ms, ratio, note`` plus ``device, date,
commit``) go to ``--json`` (default ``$OUT/kernels.json`` when ``$OUT`` is set, else
``docs/benchmarks/kernels.json``), rewritten after every row, and a markdown table is printed
last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
from triton.testing import do_bench

from qedprobe.kernels.qed import ARMS
from qedprobe.kernels.qed.chunk import qed_chunk

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # this folder's modules, also under ``python -P``
from layer_inputs import per_channel_inputs  # noqa: E402
from recurrent_decode import bench_decode  # noqa: E402

DEV = "cuda"
MAIN = dict(B=8, T=4096, H=16, HV=16, K=128, V=128)
GROUPED = dict(B=4, T=4096, H=16, HV=32, K=128, V=128)
SMALL = [dict(B=2, T=T, H=4, HV=4, K=128, V=128) for T in (600, 1000, 2048, 4096)]
"""The shapes run before the main shape is timed again (the order-independence check)."""
T_SWEEP, SWEEP_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768), 32768
GRAD_WRT = ("q", "k", "v", "g", "b", "w", "lam")


def P(*a):
    print(*a, flush=True)


def shape_of(x) -> str:
    B, T, H, K = x["q"].shape
    return f"B{B} T{T} H{H} HV{x['v'].shape[2]} K{K} V{x['v'].shape[3]}"


def ms(fn, warmup=25, rep=100):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def qed_fn(x, arm="full", probes=False):
    z = x["z"] if arm == "rand" else None
    return lambda: qed_chunk(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], x["lam"], arm=arm, z=z,
                             return_probes=probes)


def fla_fn(x):
    """fla's ``chunk_gdn2`` on ``x``; with grouped value heads (which fla 0.6.0's ``chunk_gdn2``
    refuses: q, k and g must have one shape) on ``q, k`` repeated per value head, the same problem."""
    from fla.ops.gdn2 import chunk_gdn2
    m = x["v"].shape[2] // x["q"].shape[2]
    q, k = (x[n] if m == 1 else x[n].repeat_interleave(m, dim=2) for n in ("q", "k"))
    return lambda: chunk_gdn2(q, k, x["v"], x["g"], x["b"], x["w"], use_qk_l2norm_in_kernel=True)


def fwd_bwd(fn_of_x, x, names):
    """One layer's training step: ``o = fn_of_x(leaves)()[0]``, then ``d o / d leaves[names]``."""
    leaves = {n: (t.detach().requires_grad_(True) if n in names else t) for n, t in x.items()}
    f = fn_of_x(leaves)
    do = torch.randn_like(x["v"])
    wrt = [leaves[n] for n in names]
    return lambda: torch.autograd.grad(f()[0], wrt, do)


class Rows:
    """The benchmark's rows, written to ``path`` after each one (a cut run keeps what it has)."""

    def __init__(self, path: str, commit: str):
        self.path, self.rows = path, []
        self.meta = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                         commit=commit)

    def add(self, name, shape, t_ms, ref_ms=None, note=""):
        r = dict(name=name, shape=shape, ms=round(t_ms, 4), ref_ms=round(ref_ms, 4) if ref_ms else None,
                 ratio=round(t_ms / ref_ms, 4) if ref_ms else None, note=note, **self.meta)
        self.rows.append(r)
        P(f"{name:44s} {shape:28s} {t_ms:8.3f} ms" + (f"  ratio {r['ratio']:.3f}" if ref_ms else "") + f" {note}")
        if os.path.dirname(self.path):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self.rows, f, indent=1)
        return t_ms

    def table(self) -> str:
        lines = [f"device: {self.meta['device']}, torch {torch.__version__}, commit {self.meta['commit']}", "",
                 "| row | shape | ms | ref ms | ratio |", "|---|---|---|---|---|"]
        for r in self.rows:
            ref = f"{r['ref_ms']:.3f}" if r["ref_ms"] else "-"
            ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
            lines.append(f"| {r['name']} {r['note']} | {r['shape']} | {r['ms']:.3f} | {ref} | {ratio} |")
        return "\n".join(lines)


def order_check(rows: Rows, x, fresh_ms: float):
    """Forwards on smaller shapes, then the main shape again: its time relative to the fresh one."""
    for shape in SMALL:
        small = per_channel_inputs(**shape, device=DEV, seed=shape["T"])
        qed_fn(small)()
        qed_fn(small, probes=True)()
    torch.cuda.synchronize()
    rows.add("qed_chunk fwd (full) after smaller shapes", shape_of(x), ms(qed_fn(x)), fresh_ms,
             "(ratio: vs fresh)")


def t_sweep(rows: Rows, fla: bool, left):
    for T in T_SWEEP:
        if left() < 30:
            P("budget: T sweep cut")
            return
        xn = per_channel_inputs(max(1, SWEEP_TOKENS // T), T, MAIN["H"], MAIN["HV"], MAIN["K"], MAIN["V"], device=DEV)
        f_ms = rows.add("fla chunk_gdn2 fwd", shape_of(xn), ms(fla_fn(xn))) if fla else None
        rows.add("qed_chunk fwd (full)", shape_of(xn), ms(qed_fn(xn)), f_ms)
        rows.add("qed_chunk fwd (full) + probes", shape_of(xn), ms(qed_fn(xn, probes=True)), f_ms)


def kernel_ms(fn, calls: int = 5) -> dict[str, float]:
    """Device time per call of every kernel ``fn`` launches (torch.profiler over ``calls`` calls), ms."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {e.key: getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
             for e in prof.key_averages()}
    return {key: t_us / 1e3 / calls for key, t_us in times.items() if t_us > 0}


def parts(rows: Rows, x, fla: bool):
    """Per-kernel rows: the ``qed_*`` kernels of the forward (probes off, on), every kernel of the
    forward + backward and of fla's forward."""
    fns = [("qed", qed_fn(x), False), ("qed+probes", qed_fn(x, probes=True), False),
           ("qed fwd+bwd", fwd_bwd(qed_fn, x, GRAD_WRT), True)] + ([("fla", fla_fn(x), True)] if fla else [])
    for name, fn, every_kernel in fns:
        for key, t_ms in kernel_ms(fn).items():
            if every_kernel or key.startswith("qed_"):
                rows.add(f"  {name}: {key[:40]}", shape_of(x), t_ms, note="(per call)")


def decode(rows: Rows):
    r = bench_decode(16, 16, 128, 128, torch.bfloat16)
    for label, key, note in (("", "us", "(ref: fla fused_recurrent_gdn2)"),
                             (", CUDA graph", "graph_us", "(GPU time alone; ref: fla, same)"),
                             (", host", "host_us", "(Python time per call; ref: fla, same)")):
        rows.add(f"qed_recurrent decode (1 token){label}", "B16 T1 H16 HV16 K128 V128", r[f"qed_{key}"] / 1e3,
                 (r.get(f"fla_{key}") or 0) / 1e3 or None, note)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    out = os.environ.get("OUT")
    ap.add_argument("--json", default=os.path.join(out, "kernels.json") if out else
                    os.path.join(os.path.dirname(HERE), "docs", "benchmarks", "kernels.json"))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"), help="commit the kernels are from")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; the optional sections stop after")
    ap.add_argument("--quick", action="store_true", help="main shape and the order check only")
    ap.add_argument("--parts", action="store_true", help="per-kernel times of the main shape (torch.profiler)")
    ap.add_argument("--dplr", action="store_true", help="also time fla chunk_dplr_delta_rule (autotunes ~80 s)")
    ap.add_argument("--no-fla", action="store_true", help="do not run fla (ratios against --fla-ms / --fla-fwd-bwd-ms)")
    ap.add_argument("--fla-ms", type=float, help="with --no-fla: fla's forward time to take ratios against")
    ap.add_argument("--fla-fwd-bwd-ms", type=float, help="with --no-fla: fla's forward + backward time")
    a = ap.parse_args()
    if (a.fla_ms or a.fla_fwd_bwd_ms) and not a.no_fla:
        ap.error("--fla-ms and --fla-fwd-bwd-ms replace the fla run: they need --no-fla")
    if not torch.cuda.is_available():
        P("bench/kernel_times.py needs CUDA")
        return 1
    start = time.time()
    left = lambda: a.budget - (time.time() - start)  # noqa: E731
    have_fla = False
    if not a.no_fla:
        try:
            import fla  # noqa: F401
            have_fla = True
        except ImportError:
            P("fla not importable: rows without the reference")
    rows = Rows(a.json, a.commit)
    x = per_channel_inputs(**MAIN, device=DEV)
    main = shape_of(x)

    fla_fb, fla_ms = a.fla_fwd_bwd_ms, a.fla_ms
    if have_fla:
        t0 = time.time()
        fwd_bwd(fla_fn, x, "qkvgbw")()
        torch.cuda.synchronize()
        P(f"fla chunk_gdn2 fwd+bwd first call (autotune) {time.time() - t0:.1f} s")
        fla_fb = rows.add("fla chunk_gdn2 fwd+bwd", main, ms(fwd_bwd(fla_fn, x, "qkvgbw")))
        fla_ms = rows.add("fla chunk_gdn2 fwd", main, ms(fla_fn(x)))
    t0 = time.time()
    qed_fn(x)()
    torch.cuda.synchronize()
    P(f"qed first call (compile) {time.time() - t0:.1f} s")
    fresh = rows.add("qed_chunk fwd (full), fresh", main, ms(qed_fn(x)), fla_ms)
    rows.add("qed_chunk fwd (full) + probes", main, ms(qed_fn(x, probes=True)), fla_ms)
    order_check(rows, x, fresh)
    if a.parts:
        parts(rows, x, have_fla)
    if a.quick:
        rows.add("qed_chunk fwd+bwd (full)", main, ms(fwd_bwd(qed_fn, x, GRAD_WRT)), fla_fb, "(ref: fla fwd+bwd)")
        P(rows.table())
        return 0
    # The rows with targets first (forward + backward, decode, every T), so that a budget cut by
    # fla's autotuning leaves out the rows without targets (per arm, grouped heads) first.
    if left() > 30:
        rows.add("qed_chunk fwd+bwd (full)", main, ms(fwd_bwd(qed_fn, x, GRAD_WRT)), fla_fb,
                 "(ref: fla fwd+bwd, measured first)")
    if left() > 15:
        decode(rows)
    t_sweep(rows, have_fla, left)
    for arm in ARMS:
        for probes in (False, True):
            if left() < 20:
                break
            rows.add(f"qed_chunk {arm}{' + probes' if probes else ''}", main, ms(qed_fn(x, arm, probes)), fla_ms)
    if left() > 20:
        xg = per_channel_inputs(**GROUPED, device=DEV)
        f_ms = rows.add("fla chunk_gdn2 fwd (grouped heads)", shape_of(xg), ms(fla_fn(xg))) if have_fla else None
        rows.add("qed_chunk fwd (full, grouped heads)", shape_of(xg), ms(qed_fn(xg)), f_ms)
        del xg
    if a.dplr and have_fla and left() > 120:
        from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule
        kn = torch.nn.functional.normalize(x["k"].float(), dim=-1).to(x["k"].dtype)
        dplr = lambda: chunk_dplr_delta_rule(q=x["q"], k=x["k"], v=x["v"], a=kn, b=-kn * x["b"], gk=x["g"])  # noqa: E731
        d_ms = rows.add("fla chunk_dplr_delta_rule fwd", main, ms(dplr, warmup=10, rep=50))
        rows.add("qed_chunk fwd (full) vs dplr", main, fresh, d_ms)
    P(rows.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
