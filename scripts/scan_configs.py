"""Time the two scan launches of the ``qed_chunk`` forward under other launch configurations at
the benchmark shape (or another ``--B``, ``--T``), each result compared with the rule configuration's.

    python scripts/scan_configs.py [--B 8] [--T 4096] [--H 16] [--K 128] [--V 128] [--state-only | --output-only]
        [--json PATH]
    python scripts/scan_configs.py --head-gates [--HV 16] [--B 1 --T 32768] [--state-only | --output-only | --gram-only]
        [--json PATH]

Why: the state scan's ``N * HV * cdiv(V, BV)`` programs (256 at the benchmark shape, 32 at
``--B 1 --T 32768`` with ``BV = 64``) each walk every chunk of a sequence in order, so its best value
block depends on how many programs fill the GPU's SMs (two per SM at 4 warps, one at 8;
docs/BENCHMARKS.md has the registers and spills of each configuration). The output kernel at
``BV = 128`` reads ``qg`` and ``A_qk`` (with probes also ``dg`` and ``A_dk``) once instead of twice;
in pipelined key blocks its loads can overlap its products. The fastest configuration that
matches becomes the rule.

``--head-gates``: the scalar-gate path instead (``g``, ``b``, ``w`` one per token and value head,
``--H`` q/k heads and ``--HV`` value heads, as a Qwen3.5 layer): its state scan with the decay per
row (value blocks of 16, 32 and 64, two to four stages; :data:`ROW_DECAY_STATE_CONFIGS`) beside fla's
``chunk_gated_delta_rule_fwd_h`` on the same ``w``, ``u``, keys and cumulative decay where fla is
installed, the same scan forming the output itself under those configurations against the state
scan and the output kernel together (``chunk_scan.scan_forms_output``'s choice), its output
kernel with the probe ``Sd`` (arm full: its residual form, and the patch launch, which with these
inputs forms no chunk again) and without (:data:`SCALAR_OUTPUT_CONFIGS`) and, unless one of the
two is screened alone, its Gram stage with probes off and on (:data:`GRAM_CONFIGS`;
``--gram-only``: that alone).

Needs CUDA (with ``TRITON_INTERPRET=1`` and small sizes it runs on CPU, times meaningless).
Prints one line per configuration; ``--json`` writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

from qedprobe.kernels.qed.chunk import chunk_intra_fwd, chunk_precision, direction_inputs
from qedprobe.kernels.qed import chunk_scan
from qedprobe.kernels.qed.chunk_common import chunk_layout
from qedprobe.kernels.qed.chunk_scan import (SD_MIN_DENOMINATOR, chunk_output_fwd, chunk_state_fwd, multiprocessors,
                                             output_config, scalar_output_config, scalar_output_fwd, sd_form,
                                             state_config)
from qedprobe.kernels.qed.chunk_wy import chunk_inverse_fwd, scalar_wy_fwd
from qedprobe.kernels.qed.inputs import check_qed_inputs
from qedprobe.kernels.qed.scalar_gram import gram_config, scalar_gram_fwd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from layer_inputs import head_gate_inputs, per_channel_inputs  # noqa: E402

STATE_CONFIGS = [(bv, warps, stages) for bv in (32, 64) for warps in (4, 8) for stages in (1, 2)
                 if (bv, warps, stages) != (32, 4, 1)]
"""Every (BV, warps, stages) with the value blocks the rule can take but (32, 4, 1), which faults under
Triton 3.6 (docs/BENCHMARKS.md); a fault ends every later timing of the process (on 2026-12-05 an
unidentified one ended the screen before its first row, when the list began with BV 16)."""
OUTPUT_CONFIGS = [(bv, warps, kb, stages) for bv in (64, 128) for warps in (4, 8)
                  for kb, stages in ((256, 1), (32, 2), (32, 3))]
"""(BV, warps, key block, stages) of the output kernel (``chunk_output_fwd``'s ``config``), probes off
and on; (256, 1): one key block, unpipelined, as by default."""
ROW_DECAY_STATE_CONFIGS = [(bv, 4, stages) for bv in (16, 32, 64) for stages in (2, 3, 4)]
"""(BV, warps, stages) of the scalar-gate path's state scan (``--head-gates``), alone and forming
the output itself."""
SCALAR_OUTPUT_CONFIGS = [(bv, warps, 1) for bv in (64, 128) for warps in (4, 8)]
"""(BV, warps, stages) of the scalar-gate output kernel (``--head-gates``), probes off and on."""
GRAM_CONFIGS = [(warps, 1, maxnreg) for warps in (4, 8) for maxnreg in (None, 128, 168)] + [(16, 1, None)]
"""(warps, stages, maxnreg) of the scalar-gate path's Gram stage (``--head-gates``), probes off and
on, each with a query/key head's whole group of value heads in one program and with one value head
per program (with probes each program also writes ``d`` for each of its value heads, in the first
pass over them and in a second); two stages time as one (the kernel has no loop to pipeline), and
16 warps hold at most 128 registers anyway (above it a program does not fit an SM)."""


def fla_state_scan(x, gram, wy):
    """fla's ``chunk_gated_delta_rule_fwd_h`` on the scalar-gate path's ``w``, ``u``, keys (those the
    state scan reads, in ``w``'s dtype) and cumulative decay, or None without CUDA (fla's autotuner
    needs a GPU) or fla (its keys have one head per value head: the q/k heads are repeated when
    grouped)."""
    if not torch.cuda.is_available():
        return None
    try:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    except ImportError:
        return None
    m = wy.w.shape[2] // x.k.shape[2]
    kn, gc = gram.qk_rows(x)[1].to(wy.w.dtype).repeat_interleave(m, dim=2), gram.gc.float().contiguous()
    return lambda: chunk_gated_delta_rule_fwd_h(k=kn, w=wy.w, u=wy.u, g=gc)


def state_rows(kernel: str, state, configs, rule, hs, r, P) -> list[dict]:
    """One row per state-scan configuration of ``configs`` (``state(cfg)`` launches it, writing
    ``hs`` and ``r``): its time and its largest difference from the ``rule`` configuration's states
    and residuals, which it leaves in ``hs`` and ``r`` for the output kernel to read. No ``configs``
    (``--output-only``): the rule's launch alone, untimed."""
    state(rule)()
    if not configs:
        return []
    ref_hs, ref_r = hs.clone(), r.clone()
    rows = []
    for cfg in configs:
        t = timed(state(cfg))
        rows.append(dict(kernel=kernel, BV=cfg[0], warps=cfg[1], stages=cfg[2],
                         programs=triton.cdiv(P.V, cfg[0]) * P.N * P.HV, ms=round(t, 4), rule=cfg == rule,
                         max_diff=max((hs - ref_hs).abs().max().item(), (r - ref_r).abs().max().item())))
        print(rows[-1], flush=True)
    state(rule)()
    return rows


def screened_problem(q, k, v, g, b, w, lam, dev) -> tuple:
    """``(P, inter, lay)`` of the screen's call (arm full, no varlen): the validated problem, the
    intra buffers' dtype and the chunk layout, as ``qed_chunk`` derives them."""
    P = check_qed_inputs("qed_chunk", q, k, v, g, b, w, lam, arm="full", z=None, d=None, scale=None,
                         initial_state=None, cu_seqlens=None)
    inter, prec = chunk_precision(P, q, k, v, b, w)
    return P, inter, chunk_layout(P, None, dev, prec)


def head_gate_rows(a, dev) -> list[dict]:
    """``--head-gates``: the scalar-gate path's state scan and output kernel under each configuration,
    each compared with the rule configuration's results, and fla's state scan."""
    raw = head_gate_inputs(a.B, a.T, a.H, a.HV, a.K, a.V, device=dev)
    q, k, v, g, b, w, lam = (raw[n] for n in ("q", "k", "v", "g", "beta", "beta", "lam"))
    P, inter, lay = screened_problem(q, k, v, g, b, w, lam, dev)
    x = direction_inputs(P, q, k, b, lam, "full", None, None, True)
    if a.gram_only:
        return gram_rows(x, g, lay, inter)
    gram, akk = scalar_gram_fwd(x, g, lay=lay, inter_dtype=inter, probes=True, patch_below=SD_MIN_DENOMINATOR)
    wy = scalar_wy_fwd(x, gram, v, w, chunk_inverse_fwd(akk, lay=lay, out_dtype=inter), lay=lay)
    hs, r = torch.empty(lay.NC, P.HV, P.K, P.V, device=dev, dtype=inter), torch.empty_like(wy.u)
    o, sd = torch.empty_like(v), torch.empty(v.shape, device=dev, dtype=P.compute_dtype)

    def state(cfg):
        return lambda: chunk_state_fwd(lay, w=wy.w, u=wy.u, kg=gram.qk_rows(x)[1], gl=None, gc=gram.gc, hs=hs,
                                       r=r, T=P.T, N=P.N, config=cfg)

    def output(cfg, probes):
        return lambda: scalar_output_fwd(lay, x, gram, v=v, w=w, hs=hs, r=r, o=o, scale=P.scale,
                                         sd=sd if probes else None, config=cfg)

    def in_scan(cfg):
        return lambda: chunk_state_fwd(lay, w=wy.w, u=wy.u, kg=gram.qk_rows(x)[1], gl=None, gc=gram.gc, hs=None,
                                       q=gram.qk_rows(x)[0], rq=gram.rq, o=o, scale=P.scale, T=P.T, N=P.N, config=cfg)

    rule = state_config(P.K, P.V, inter, scans=P.N * P.HV, sm_count=multiprocessors(q.device), row_decay=True)
    rows = state_rows("qed_state_kernel (decay per row)", state,
                      [] if a.output_only else list(dict.fromkeys(ROW_DECAY_STATE_CONFIGS + [rule])), rule, hs, r, P)
    if not a.output_only:
        rows += scan_output_rows(in_scan, lambda: (state(rule)(), output(None, False)()), rule, o, P)
    fla = None if a.output_only else fla_state_scan(x, gram, wy)
    if fla is not None:
        rows.append(dict(kernel="fla chunk_gated_delta_rule_fwd_h", ms=round(timed(fla), 4)))
        print(rows[-1], flush=True)
    if a.state_only:
        return rows
    if not a.output_only:
        rows += gram_rows(x, g, lay, inter)
    for probes in (False, True):
        out_rule = scalar_output_config(P.V, inter, probes and sd_form(x.flags) == "stacked")
        output(out_rule, probes)()
        ref_o, ref_sd = o.clone(), sd.clone()
        for cfg in list(dict.fromkeys(SCALAR_OUTPUT_CONFIGS + [out_rule])):
            t = timed(output(cfg, probes))
            diff = (o - ref_o).abs().max().item()
            if probes:
                diff = max(diff, (sd - ref_sd).abs().max().item())
            rows.append(dict(kernel="qed_scalar_output_kernel", BV=cfg[0], warps=cfg[1], stages=cfg[2], probes=probes,
                             ms=round(t, 4), rule=cfg == out_rule, max_diff=diff))
            print(rows[-1], flush=True)
    return rows


def scan_output_rows(in_scan, staged, rule, o, P) -> list[dict]:
    """The scalar-gate scan forming the output itself (``in_scan(cfg)`` launches ``chunk_state_fwd``
    with ``o``, no ``hs, R``) under each of :data:`ROW_DECAY_STATE_CONFIGS` and the state scan's
    ``rule``, each ``o`` compared with the two-launch path's (``staged()``: the state scan at
    ``rule`` writing ``hs, r``, then the output kernel at its rule, probes off), which is timed as
    one row too: where the scan forming ``o`` beats that row, ``chunk_scan.scan_forms_output`` may
    take it. ``staged()`` runs last again, leaving ``hs, r`` as the rule writes them."""
    staged()
    ref = o.clone()
    rows = [dict(kernel="state scan + scalar output kernel (rules)", ms=round(timed(staged), 4))]
    print(rows[-1], flush=True)
    for cfg in dict.fromkeys(ROW_DECAY_STATE_CONFIGS + [rule]):
        t = timed(in_scan(cfg))
        rows.append(dict(kernel="qed_state_kernel forming o", BV=cfg[0], warps=cfg[1], stages=cfg[2],
                         programs=triton.cdiv(P.V, cfg[0]) * P.N * P.HV, ms=round(t, 4), rule=cfg == rule,
                         max_diff=(o - ref).abs().max().item()))
        print(rows[-1], flush=True)
    staged()
    return rows


def gram_rows(x, g, lay, inter) -> list[dict]:
    """The scalar-gate Gram stage under each of :data:`GRAM_CONFIGS` (value heads per program: the
    group, one) and its rule's, probes on (``d`` written in the first pass or a second) and off,
    each compared with the rule configuration's outputs (every field it writes and the scores)."""
    def written(out):
        gram, akk = out
        return [t for t in vars(gram).values() if t is not None] + [akk]

    rows = []
    group = g.shape[2] // x.q.shape[2]
    for probes in (True, False):
        rule = gram_config(x.q.shape[-1], group, probes)
        late = (False, True) if probes else (True,)
        configs = list(dict.fromkeys([(w, st, per, reg, d_late) for w, st, reg in GRAM_CONFIGS for per in (group, 1)
                                      for d_late in late] + [rule]))
        ref = written(scalar_gram_fwd(x, g, lay=lay, inter_dtype=inter, probes=probes))
        for cfg in configs:
            run = lambda: scalar_gram_fwd(x, g, lay=lay, inter_dtype=inter, probes=probes, config=cfg)  # noqa: E731
            t = timed(run)
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(written(run()), ref, strict=True))
            rows.append(dict(kernel="qed_scalar_gram_kernel", warps=cfg[0], stages=cfg[1], value_heads=cfg[2],
                             maxnreg=cfg[3], d_late=cfg[4], probes=probes, ms=round(t, 4), rule=cfg == rule, max_diff=diff))
            print(rows[-1], flush=True)
    return rows


def timed(fn) -> float:
    """Median ms of ``fn`` (``do_bench``) on a GPU; one call's wall time in the interpreter."""
    if torch.cuda.is_available():
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for n, v in dict(B=8, T=4096, H=16, K=128, V=128).items():
        ap.add_argument(f"--{n}", type=int, default=v)
    ap.add_argument("--HV", type=int, default=None, help="value heads (--head-gates; default --H)")
    ap.add_argument("--head-gates", action="store_true",
                    help="screen the scalar-gate path's state scan and output kernel (g, b, w per value head)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--state-only", action="store_true", help="screen the state scan only, not the output kernel")
    ap.add_argument("--output-only", action="store_true",
                    help="screen the output kernel only (the state scan launched once at its rule)")
    ap.add_argument("--gram-only", action="store_true", help="screen the Gram stage only (--head-gates)")
    a = ap.parse_args()
    if a.state_only + a.output_only + a.gram_only > 1:
        ap.error("--state-only, --output-only and --gram-only exclude each other")
    if a.gram_only and not a.head_gates:
        ap.error("--gram-only screens the scalar-gate path's Gram stage: it needs --head-gates")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if a.HV is not None and not a.head_gates:
        ap.error("--HV is the scalar-gate path's value heads: it needs --head-gates")
    a.HV = a.H if a.HV is None else a.HV
    if a.HV % a.H:
        ap.error(f"--HV must be a multiple of --H (grouped value heads), got --HV {a.HV} with --H {a.H}")
    if a.head_gates:
        write_rows(a, dev, head_gate_rows(a, dev))
        return
    x = per_channel_inputs(a.B, a.T, a.H, a.H, a.K, a.V, device=dev)
    q, k, v, g, b, w, lam = (x[n] for n in ("q", "k", "v", "g", "b", "w", "lam"))
    P, inter, lay = screened_problem(q, k, v, g, b, w, lam, dev)
    intra = chunk_intra_fwd(direction_inputs(P, q, k, b, lam, "full", None, None, True), v, w, g, scale=P.scale,
                            lay=lay, inter=inter, probes=True)
    hs, r = torch.empty(lay.NC, P.HV, P.K, P.V, device=dev, dtype=inter), torch.empty_like(intra.wy.u)
    o = torch.empty_like(v)
    sd = torch.empty(v.shape, device=dev, dtype=P.compute_dtype)

    def state(config):
        return lambda: chunk_state_fwd(lay, w=intra.wy.w, u=intra.wy.u, kg=intra.prep.kg, gl=intra.prep.gl, hs=hs,
                                       r=r, T=P.T, N=P.N, config=config)

    def output(cfg, probes):
        extra = dict(dg=intra.prep.dg, adk=intra.adk, sd=sd) if probes else {}
        return lambda: chunk_output_fwd(lay, qg=intra.prep.qg, aqk=intra.aqk, hs=hs, r=r, o=o, config=cfg, **extra)

    def effective(cfg):
        """An output configuration as launched: value and key blocks clipped to V and K."""
        bv, warps, kb, stages = cfg
        return min(bv, triton.next_power_of_2(P.V)), warps, min(kb, triton.next_power_of_2(P.K)), stages

    rule = state_config(P.K, P.V, inter, scans=P.N * P.HV, sm_count=multiprocessors(q.device))
    rows = state_rows("qed_state_kernel", state, [] if a.output_only else STATE_CONFIGS, rule, hs, r, P)
    out_rules = {p: (*output_config(P.V, inter, p), chunk_scan.OUTPUT_KEY_BLOCK, chunk_scan.OUTPUT_STAGES)
                 for p in (False, True)}
    out_configs = [] if a.state_only else list(dict.fromkeys(
        [effective(c) for c in OUTPUT_CONFIGS] + [effective(c) for c in out_rules.values()]))
    refs = {}
    for p, cfg in ([] if a.state_only else out_rules.items()):
        output(cfg, p)()
        refs[p] = (o.clone(), sd.clone() if p else None)
    for cfg in out_configs:
        for p in (False, True):
            t = timed(output(cfg, p))
            diff = (o - refs[p][0]).abs().max().item()
            if p:
                diff = max(diff, (sd - refs[p][1]).abs().max().item())
            rows.append(dict(kernel="qed_output_kernel", BV=cfg[0], warps=cfg[1], key_block=cfg[2], stages=cfg[3],
                             probes=p, ms=round(t, 4), rule=cfg == effective(out_rules[p]), max_diff=diff))
            print(rows[-1], flush=True)
    write_rows(a, dev, rows)


def write_rows(a, dev, rows) -> None:
    """``rows`` with the shape and device to ``--json``, where given."""
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(shape=vars(a), device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
