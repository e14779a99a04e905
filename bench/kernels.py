"""Prefill benchmark: qed_chunk forward against fla 0.6.0 in one run (CUDA only).

    PYTHONUNBUFFERED=1 python3 bench/kernels.py [--dplr] [--quick]

Rows (median of ``triton.testing.do_bench``, bf16 inputs, float32 log-decay, qk L2-norm in kernel):
* B=8, T=4096, H=16, K=V=128: qed_chunk (arm full) with probes off / on, fla ``chunk_gdn2``;
  ``--dplr`` adds fla ``chunk_dplr_delta_rule`` (its first call autotunes for ~80 s);
* every arm, probes off and on, same shape;
* T = 1K .. 32K with B*T = 32K tokens (B = 32 .. 1), qed vs fla;
* forward + backward (one layer's training step: ``torch.autograd.grad`` of ``o`` w.r.t. every
  input, the Triton backward of ``kernels/qed/chunk_bwd.py``), qed vs fla ``chunk_gdn2``;
* a decode row from ``bench/recurrent_decode.py`` (``bench_decode``) when that file exists;
* with ``--parts``, one row per qed kernel (``qed_prep_kernel``, ``qed_solve_kernel``,
  ``qed_scan_kernel``; torch.profiler, ms per call), probes off and on.
Old against new intra kernels in one call: ``bench/intra_compare.py``.
Prints a markdown table last and writes it (and a JSON of all rows) to ``$OUT`` when set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from triton.testing import do_bench

from qedprobe.kernels.qed import ARMS
from qedprobe.kernels.qed.chunk import qed_chunk

DEV = "cuda"


def P(*a):
    print(*a, flush=True)


def inputs(B, T, H, K, V, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(B, T, H, K, device=DEV, dtype=dtype)
    k = torch.randn(B, T, H, K, device=DEV, dtype=dtype)
    v = torch.randn(B, T, H, V, device=DEV, dtype=dtype) * 0.5
    g = -torch.rand(B, T, H, K, device=DEV, dtype=torch.float32) * 0.1
    b = torch.rand(B, T, H, K, device=DEV, dtype=dtype)
    w = torch.rand(B, T, H, V, device=DEV, dtype=dtype)
    lam = 0.1 * torch.ones(H, device=DEV, dtype=torch.float32)
    z = torch.nn.functional.normalize(torch.randn(H, K, device=DEV), dim=-1)
    return dict(q=q, k=k, v=v, g=g, b=b, w=w, lam=lam, z=z)


def ms(fn, warmup=25, rep=100):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def qed_fn(x, arm="full", probes=False):
    z = x["z"] if arm == "rand" else None
    return lambda: qed_chunk(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], x["lam"], arm=arm, z=z,
                             return_probes=probes)


def fla_fn(x):
    from fla.ops.gdn2 import chunk_gdn2
    return lambda: chunk_gdn2(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], use_qk_l2norm_in_kernel=True)


def fwd_bwd(fn_of_x, x, names):
    """One layer's training step: ``o = fn_of_x(leaves)()[0]``, then ``d o / d leaves[names]``."""
    leaves = {n: (t.detach().requires_grad_(True) if n in names else t) for n, t in x.items()}
    f = fn_of_x(leaves)
    do = torch.randn_like(x["v"])
    wrt = [leaves[n] for n in names]
    return lambda: torch.autograd.grad(f()[0], wrt, do)


def dplr_fn(x):
    from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule
    kn = torch.nn.functional.normalize(x["k"].float(), dim=-1).to(x["k"].dtype)
    bb = -kn * x["b"]
    return lambda: chunk_dplr_delta_rule(q=x["q"], k=x["k"], v=x["v"], a=kn, b=bb, gk=x["g"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dplr", action="store_true", help="also time fla chunk_dplr_delta_rule (autotunes ~80 s)")
    ap.add_argument("--quick", action="store_true", help="main shape only")
    ap.add_argument("--parts", action="store_true", help="per-kernel times (torch.profiler)")
    ap.add_argument("--no-fla", action="store_true", help="leave fla out of the main shape")
    ap.add_argument("--fla-ms", type=float, default=None, help="fla chunk_gdn2 time to use for ratios")
    ap.add_argument("--fla-fb-ms", type=float, default=None,
                    help="fla chunk_gdn2 forward+backward time to use for ratios (anchor: 11.25)")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; optional sections stop after")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        P("bench/kernels.py needs CUDA")
        return 1
    start = time.time()
    try:
        import fla  # noqa: F401
        have_fla = True
    except ImportError:
        have_fla = False

    def left():
        return a.budget - (time.time() - start)
    rows = []

    def row(name, shape, t_ms, ref_ms=None, note=""):
        r = dict(name=name, shape=shape, ms=t_ms, ref_ms=ref_ms,
                 ratio=(t_ms / ref_ms) if ref_ms else None, note=note)
        rows.append(r)
        P(f"{name:34s} {shape:22s} {t_ms:8.3f} ms" + (f"  ratio {r['ratio']:.3f}" if ref_ms else "") + f" {note}")
        return t_ms

    B, T, H, K, V = 8, 4096, 16, 128, 128
    shape = f"B{B} T{T} H{H} K{K} V{V}"
    x = inputs(B, T, H, K, V)
    t0 = time.time()
    qed_fn(x)()
    torch.cuda.synchronize()
    P(f"qed first call (compile) {time.time() - t0:.1f} s")
    fla_ms = a.fla_ms
    if have_fla and not a.no_fla:
        t0 = time.time()
        fla_fn(x)()
        torch.cuda.synchronize()
        P(f"fla chunk_gdn2 first call {time.time() - t0:.1f} s")
        fla_ms = row("fla chunk_gdn2 fwd", shape, ms(fla_fn(x)))
    nbytes = sum(t.numel() * t.element_size() for n, t in x.items() if n in "qkvgbw") + x["v"].numel() * 2
    q_ms = row("qed_chunk fwd (full)", shape, ms(qed_fn(x)), fla_ms)
    row("qed_chunk fwd (full) + probes", shape, ms(qed_fn(x, probes=True)), fla_ms)
    P(f"bytes in+out once: {nbytes / 1e9:.3f} GB -> {nbytes / q_ms / 1e6:.0f} GB/s effective, "
      f"floor at 4.3 TB/s {nbytes / 4.3e9:.3f} ms")
    if a.parts:
        from torch.profiler import ProfilerActivity, profile
        fns = [("qed", qed_fn(x)), ("qed+probes", qed_fn(x, probes=True))]
        fns += [("fla", fla_fn(x))] if (have_fla and not a.no_fla) else []
        for name, fn in fns:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            P(f"--- {name}: 5 calls")
            P(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60))
            for e in prof.key_averages():  # per-kernel rows of the table: intra kernel(s), scan kernel
                t_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                if e.key.startswith("qed_") and t_us > 0:
                    row(f"  {name}: {e.key}", shape, t_us / 1e3 / 5, note="(per call)")
    if a.dplr and have_fla:
        t0 = time.time()
        try:
            dplr_fn(x)()
            torch.cuda.synchronize()
            P(f"dplr first call (autotune) {time.time() - t0:.1f} s")
            d_ms = ms(dplr_fn(x), warmup=10, rep=50)
            row("fla chunk_dplr_delta_rule fwd", shape, d_ms)
            row("qed_chunk fwd (full) vs dplr", shape, q_ms, d_ms)
        except Exception as err:  # noqa: BLE001
            P("dplr failed:", repr(err)[:300])
    if not a.quick:
        del x
        for Tn in (1024, 2048, 4096, 8192, 16384, 32768):
            if left() < 20:
                P("budget: T sweep cut")
                break
            Bn = max(1, 32768 // Tn)
            shp = f"B{Bn} T{Tn} H{H} K{K} V{V}"
            xn = inputs(Bn, Tn, H, K, V)
            # fla only where its autotuning already ran in this process (or was asked for)
            use_fla = have_fla and (not a.no_fla or "fla.ops.gdn2" in sys.modules)
            f_ms = ms(fla_fn(xn)) if use_fla else None
            if f_ms:
                row("fla chunk_gdn2 fwd", shp, f_ms)
            row("qed_chunk fwd (full)", shp, ms(qed_fn(xn)), f_ms)
            row("qed_chunk fwd (full) + probes", shp, ms(qed_fn(xn, probes=True)), f_ms)
            del xn
        here = os.path.dirname(os.path.abspath(__file__))
        if left() > 30 and os.path.exists(os.path.join(here, "recurrent_decode.py")):
            sys.path.insert(0, here)
            try:
                from recurrent_decode import bench_decode
                r = bench_decode(16, 16, 128, 128, torch.bfloat16)
                row("qed_recurrent decode (1 token)", "B16 H16 K128 V128", r["qed_us"] / 1e3,
                    r.get("fla_us", 0) / 1e3 or None, "(fla fused_recurrent_gdn2)")
            except Exception as err:  # noqa: BLE001
                P("decode bench failed:", repr(err)[:300])
        x = inputs(B, T, H, K, V)
        for arm in ARMS:
            for probes in (False, True):
                if left() < 25:
                    P(f"budget: arm sweep cut before {arm}")
                    break
                row(f"qed_chunk {arm}{' +probes' if probes else ''}", shape, ms(qed_fn(x, arm, probes)), fla_ms)
    # Forward + backward last: fla autotunes its backward on the first call (minutes on an H200),
    # so everything above is on record before it starts. The ratio is against --fla-fb-ms (the
    # anchor) first, then against fla measured here.
    try:
        qfb_ms = row("qed_chunk fwd+bwd (full)", shape,
                     ms(fwd_bwd(qed_fn, x, ("q", "k", "v", "g", "b", "w", "lam"))), a.fla_fb_ms,
                     note="(ratio vs --fla-fb-ms)" if a.fla_fb_ms else "")
    except Exception as err:  # noqa: BLE001 - report and go on
        P("qed_chunk fwd+bwd failed:", repr(err)[:300])
        qfb_ms = None
    if have_fla and not a.no_fla and left() > 60:
        t0 = time.time()
        fwd_bwd(fla_fn, x, "qkvgbw")()
        torch.cuda.synchronize()
        P(f"fla chunk_gdn2 fwd+bwd first call (autotune) {time.time() - t0:.1f} s")
        fb_ms = row("fla chunk_gdn2 fwd+bwd", shape, ms(fwd_bwd(fla_fn, x, "qkvgbw")), note="(anchor 11.25 ms)")
        if qfb_ms:
            row("qed_chunk fwd+bwd (full) vs fla measured", shape, qfb_ms, fb_ms)

    dev = torch.cuda.get_device_name()
    lines = [f"device: {dev}, torch {torch.__version__}, bf16 inputs, float32 g, qk L2-norm in kernel", "",
             "| kernel | shape | ms | ratio vs fla |", "|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
        lines.append(f"| {r['name']} {r['note']} | {r['shape']} | {r['ms']:.3f} | {ratio} |")
    table = "\n".join(lines)
    P(table)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "kernels_bench.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(out, "kernels_bench.json"), "w") as f:
            json.dump({"device": dev, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
