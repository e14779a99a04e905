"""Compile qed_chunk's kernels for sm_90 on a machine without a GPU (Triton's AOT path and the
ptxas Triton itself uses for sm_90) and print shared memory, registers and spills per kernel.

    python bench/chunk_aot.py [fwd|bwd|all] [--warps N] [--K 128] [--V 128] [--head [--HV 32]] [--mix]

``fwd``: the six forward kernels (prep, scores, inverse, W/U, state scan, output) at bf16 (or, with ``--fp32``,
float32) inputs / float32 state, probes off and on, with the warps and slices ``qed_chunk`` launches them with (or
``--warps``), or with ``--head`` the five of the scalar-gate path (``g, b, w`` ``[B, T, HV]``: Gram, inverse,
W/U, state scan with the decay per row, alone and forming the output itself, output; 16 q/k heads and ``--HV``
value heads); ``bwd``: the backward's prep
(with the ``HATS`` its scores kernel loads) and the five backward
kernels the same way (bf16 inputs, or ``--fp32``). Every pointer is taken 16-byte aligned, as the
JIT specializes a launch on torch's tensors (without it the loads and stores are compiled scalar and
the register figures are not the device's). It reproduced the device's shared-memory figure
(294912 B for the float32 scan with two stages) exactly, so configurations can be screened here
before spending device time. ``--mix`` adds each kernel's SASS instruction mix (``nvdisasm`` of
the cubin: the total and the counts of the tensor-core, memory, barrier and float opcodes), to
compare two forms of a kernel instruction by instruction.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from qedprobe.kernels.qed import chunk_intra, chunk_wy, scalar_gram
from qedprobe.kernels.qed.chunk_bwd_intra import (DG_BWD_BKS, DG_BWD_WARPS, SCORES_BWD_BKS, SCORES_BWD_WARPS,
                                                   WY_BWD_BKS, WY_BWD_BVS, WY_BWD_WARPS, qed_bwd_dg_kernel,
                                                   qed_bwd_scores_kernel, qed_bwd_wy_kernel)
from qedprobe.kernels.qed.chunk_bwd_prep import PREP_BWD_BKS, PREP_BWD_WARPS, qed_prep_bwd_kernel
from qedprobe.kernels.qed.chunk_bwd_scan import STATE_BKP, STATE_BV, STATE_WARPS, qed_dstate_kernel
from qedprobe.kernels.qed.chunk_common import BC, BT
from qedprobe.kernels.qed import chunk_scan
from qedprobe.kernels.qed.chunk_scan import (output_config, qed_output_kernel, qed_scalar_output_kernel, qed_state_kernel,
                                             scalar_output_config, state_config)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder's modules, also under ``python -P``
from forward_traffic import H200_SMS  # noqa: E402

TGT = GPUTarget("cuda", 90, 32)
MIX_OPCODES = ("HGMMA", "LDG", "STG", "LDS", "STS", "LDSM", "BAR", "FMUL", "FFMA", "FADD", "MUFU", "F2FP")
"""The opcodes ``--mix`` counts (beside the total)."""
show_mix = False
"""Set by ``--mix``: :func:`compile_` prints each kernel's instruction mix."""
FULL = {"DIR_SOURCE": "q", "DIR_GATED": True, "DIR_PROJECTED": True}  # arm "full"


def _jit(kern) -> JITFunction:
    """The JITFunction under ``@triton.heuristics`` / ``@triton.autotune`` wrappers."""
    while not isinstance(kern, JITFunction):
        kern = kern.fn
    return kern


def compile_(kern, types: dict, consts: dict, num_warps: int, num_stages: int = 1, maxnreg: int | None = None) -> str:
    """Compile ``kern`` with argument ``types`` (pointer / scalar type strings) and ``consts``
    (constexprs, ``None`` for absent pointers) and the launch's register cap ``maxnreg``; print and
    return ptxas' resource line."""
    jit = _jit(kern)
    names = list(inspect.signature(jit.fn).parameters)
    missing = [n for n in names if n not in consts and n not in types]
    if missing:
        raise KeyError(f"{jit.fn.__name__}: no type or value for {missing}")
    sig = {n: ("constexpr" if n in consts else types[n]) for n in names}
    # As the JIT specializes a launch on tensors from torch's allocator: every pointer 16-byte
    # aligned (without it the loads and stores are not vectorized and the register figures differ).
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n, t in types.items() if t.startswith("*")}
    src = ASTSource(fn=jit, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs=aligned)
    t = time.time()
    k = triton.compile(src, target=TGT, options=dict(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    r = subprocess.run([get_ptxas(TGT.arch).path, "--gpu-name", "sm_90a", "-v", f.name, "-o", os.devnull],
                       capture_output=True, text=True)
    os.unlink(f.name)
    lines = (r.stderr + r.stdout).splitlines()
    info = " ".join(x.strip() for x in lines if "Used" in x or "spill" in x) or r.stderr[-300:]
    info = re.sub(r"\s+", " ", re.sub(r"ptxas\S* info\s*:", "", info))
    print(f"{jit.fn.__name__:22s} warps {num_warps} stages {num_stages}: shared {k.metadata.shared} B, "
          f"compile {time.time() - t:.1f}s | {info}", flush=True)
    if show_mix:
        mix = instruction_mix(k.asm["cubin"])
        print(f"{'':22s} SASS {sum(mix.values())} instructions: "
              + " ".join(f"{op} {mix.get(op, 0)}" for op in MIX_OPCODES), flush=True)
    return info


def instruction_mix(cubin: bytes) -> collections.Counter:
    """Opcode counts (modifiers dropped: ``FMUL.FTZ`` is ``FMUL``) of a cubin's SASS, from the
    ``nvdisasm`` beside Triton's ``ptxas``."""
    nvdisasm = os.path.join(os.path.dirname(get_ptxas(TGT.arch).path), "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    return collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M))


def compile_prep(io: str, K: int, H: int, probes: bool, hats: bool, warps: int | None):
    """``qed_prep_kernel`` as the forward (``hats`` off) or the backward's rerun (``hats`` on,
    probes off) launches it; ``io`` the inputs' and intermediates' type string."""
    opt = lambda on, **kw: kw if on else {}  # noqa: E731
    absent = lambda on, *names: {} if on else {n: None for n in names}  # noqa: E731
    compile_(chunk_intra.qed_prep_kernel,
             dict(q=f"*{io}", k=f"*{io}", b=f"*{io}", lam="*fp32", T="i32", g="*fp32", rq="*fp32", rk="*fp32",
                  cp="*fp32", gc="*fp32", kg=f"*{io}", qg=f"*{io}", ag=f"*{io}", gl="*fp32", scale="fp32",
                  **opt(probes, dg=f"*{io}", rho="*fp32", eig="*fp32", d_out="*fp32"),
                  **opt(hats, qs="*fp32", kh="*fp32", a_out="*fp32")),
             dict(H=H, HV=H, K=K, BT=BT, DT=tl.float32, IS_VARLEN=False, LAM_TOKEN=False, cu_seqlens=None,
                  chunk_indices=None, z=None, d_in=None, **FULL, BKS=min(chunk_intra.PREP_BKS, K), L2NORM=True,
                  PROBES=probes, HATS=hats, B_HEAD=False, HEADS_FIRST=True, **absent(probes, "dg", "rho", "eig", "d_out"),
                  **absent(hats, "qs", "kh", "a_out")),
             warps or chunk_intra.PREP_WARPS, maxnreg=chunk_intra.prep_maxnreg(probes, hats))


def forward(probes: bool, K: int, V: int, H: int = 16, warps: int | None = None, scores_bks: int | None = None,
            fp32: bool = False):
    """The forward kernels as ``qed_chunk`` launches them for bf16 inputs (intermediate buffers bf16,
    tf32 products) or, with ``fp32``, float32 inputs (float32 buffers, tf32x3); float32 state."""
    io, prec = ("fp32", "tf32x3") if fp32 else ("bf16", "tf32")
    print(f"--- forward, {io} inputs, float32 state, probes {probes}, K={K} V={V}")
    opt = lambda name, t: {name: t} if probes else {}  # noqa: E731
    absent = lambda *names: {} if probes else {n: None for n in names}  # noqa: E731
    common = dict(H=H, HV=H, K=K, BT=BT, DT=tl.float32, IS_VARLEN=False, LAM_TOKEN=False, cu_seqlens=None,
                  chunk_indices=None, z=None, d_in=None)
    dirs = {"DIR_SOURCE": FULL["DIR_SOURCE"], "DIR_GATED": FULL["DIR_GATED"]}
    inputs = dict(q=f"*{io}", k=f"*{io}", b=f"*{io}", lam="*fp32", T="i32")
    compile_prep(io, K, H, probes, hats=False, warps=warps)
    scores_types = dict(inputs, gc="*fp32", rq="*fp32", rk="*fp32", cp="*fp32", aqk=f"*{io}", akk="*fp32",
                        scale="fp32", **opt("adk", f"*{io}"))
    compile_(chunk_intra.qed_scores_kernel, scores_types,
             dict(common, **dirs, BC=BC, BKS=min(scores_bks or chunk_intra.SCORES_BKS, K), PREC=prec,
                  SPAN=chunk_intra.SPAN_MAX, PROBES=probes, B_HEAD=False, HEADS_FIRST=True, **absent("adk")),
             warps or chunk_intra.SCORES_WARPS)
    if not probes:  # the inverse and W/U kernels do not depend on the probes
        compile_(chunk_wy.qed_inverse_kernel, dict(akk="*fp32", ai=f"*{io}", T="i32"),
                 dict(HV=H, BT=BT, BC=BC, DT=tl.float32, PREC=prec, IS_VARLEN=False, cu_seqlens=None, chunk_indices=None,
                      HEADS_FIRST=True), warps or chunk_wy.INVERSE_WARPS)
        compile_(chunk_wy.qed_wy_kernel,
                 dict(ag=f"*{io}", v=f"*{io}", w_gate=f"*{io}", ai=f"*{io}", w=f"*{io}", u=f"*{io}", T="i32"),
                 dict(HV=H, K=K, V=V, BT=BT, BKS=min(chunk_wy.WY_BKS, K), BVS=min(chunk_wy.WY_BVS, V), W_HEAD=False,
                      DT=tl.float32, PREC=prec, IS_VARLEN=False, cu_seqlens=None, chunk_indices=None,
                      HEADS_FIRST=True), warps or chunk_wy.WY_WARPS)
    dtype = torch.float32 if fp32 else torch.bfloat16
    BK = triton.next_power_of_2(K)
    # the state scan (independent of the probes) at each configuration its rule can take: many
    # scans, and one (few, long sequences)
    configs = {state_config(K, V, dtype, scans=n, sm_count=H200_SMS) for n in (1 << 20, 1)} if not probes else ()
    for BV, nw, stages in sorted(configs):
        print(f"BV={BV:<3d}", end=" ")
        compile_state(io, prec, H, H, K, V, BV, warps or nw, stages, row_decay=False)
    out_bv, out_warps = output_config(V, dtype, probes)
    compile_(qed_output_kernel,
             dict(qg=f"*{io}", aqk=f"*{io}", hs=f"*{io}", r=f"*{io}", o=f"*{io}", T="i32", **opt("dg", f"*{io}"),
                  **opt("adk", f"*{io}"), **opt("sd", "*fp32")),
             dict(HV=H, K=K, V=V, BT=BT, BK=min(chunk_scan.OUTPUT_KEY_BLOCK, BK), BV=out_bv, PREC=prec,
                  PROBES=probes, IS_VARLEN=False, cu_seqlens=None, chunk_indices=None, HEADS_FIRST=True,
                  **absent("dg", "adk", "sd")),
             warps or out_warps, chunk_scan.OUTPUT_STAGES)


def compile_state(io: str, prec: str, H: int, HV: int, K: int, V: int, BV: int, warps: int, stages: int, *,
                  row_decay: bool, output: bool = False, fold: bool = False):
    """``qed_state_kernel`` at one configuration: per-channel decay (``kg, gl`` per value head) or,
    with ``row_decay``, the scalar-gate path's (keys of the q/k head, ``G`` per row); with
    ``output`` the scalar-gate scan that forms the output itself (the queries' norms applied at its
    store with ``fold``) instead of storing the chunk-start states and residuals."""
    keys = dict(kg=f"*{io}", gc="*fp32") if row_decay else dict(kg=f"*{io}", gl="*fp32")
    stored = dict(q=f"*{io}", o=f"*{io}", scale="fp32", **({"rq": "*fp32"} if fold else {})) if output else \
        dict(hs=f"*{io}", r=f"*{io}")
    absent = dict(hs=None, r=None, **({} if fold else {"rq": None})) if output else dict(q=None, rq=None, o=None,
                                                                                          scale=1.0)
    compile_(qed_state_kernel,
             dict(w=f"*{io}", u=f"*{io}", h0="*fp32", ht="*fp32", T="i32", **keys, **stored),
             dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=triton.next_power_of_2(K), BV=BV, DT=tl.float32, PREC=prec,
                  WHILE_LOOP=False, USE_H0=True, STORE_HT=True, STORE_HS=not output, STORE_R=not output,
                  OUTPUT=output, IS_VARLEN=False, ROW_DECAY=row_decay, cu_seqlens=None, chunk_offsets=None,
                  **({"gl": None} if row_decay else {"gc": None}), **absent),
             warps, stages)


def scalar_forward(probes: bool, K: int, V: int, H: int = 16, HV: int = 32, warps: int | None = None,
                   fp32: bool = False):
    """The scalar-gate path's kernels as ``qed_chunk`` launches them for per-head ``g, b = w``
    (``[B, T, HV]``), arm full, lambda per head, bf16 inputs (or float32 with ``fp32``); the state
    scan at its rule's configurations for many scans (sequences x value heads), for 64 and for one;
    the norms folded or ``q_hat, k_hat`` stored as ``scalar_gram.folds_norms`` rules."""
    io, prec = ("fp32", "tf32x3") if fp32 else ("bf16", "tf32")
    dtype = torch.float32 if fp32 else torch.bfloat16
    scores = {torch.float16: "fp16", torch.float32: "fp32"}[scalar_gram.scores_dtype(dtype, torch.float32)]
    print(f"--- scalar-gate forward, {io} inputs, float32 state, probes {probes}, H={H} HV={HV} K={K} V={V}")
    absent = lambda *names: {} if probes else {n: None for n in names}  # noqa: E731
    opt = lambda **kw: kw if probes else {}  # noqa: E731
    common = dict(H=H, HV=HV, K=K, BT=BT, DT=tl.float32, PREC=prec, IS_VARLEN=False, cu_seqlens=None,
                  chunk_indices=None)
    fold = scalar_gram.folds_norms(H, HV, writes_d=probes)
    gram_warps, gram_stages, per_program, gram_maxnreg, d_late = scalar_gram.gram_config(K, HV // H, probes)
    norms, hats = dict(rq="*fp32", rk="*fp32"), dict(qn=f"*{io}", kn=f"*{io}")
    compile_(scalar_gram.qed_scalar_gram_kernel,
             dict(q=f"*{io}", k=f"*{io}", g="*fp32", b=f"*{io}", lam="*fp32", gc="*fp32", alpha="*fp32",
                  gamma="*fp32", akk=f"*{scores}", T="i32", patch_below="fp32", **(norms if fold else hats),
                  **opt(rho="*fp32", eig="*fp32", cp="*fp32", d_out="*fp32", patch="*i8")),
             dict(common, BK=triton.next_power_of_2(K), IT=tl.float32 if fp32 else tl.bfloat16, L2NORM=True, **FULL,
                  LAM_TOKEN=False, PROBES=probes, WRITE_D=probes, STORE_HATS=not fold, z=None, d_in=None,
                  HEADS_FIRST=True, VH_BLOCK=per_program, D_LATE=d_late, FLAG_PATCH=probes,
                  **absent("rho", "eig", "cp", "d_out", "patch"),
                  **dict.fromkeys(hats if fold else norms)),
             warps or gram_warps, gram_stages, maxnreg=gram_maxnreg)
    if not probes:
        compile_(chunk_wy.qed_inverse_kernel, dict(akk=f"*{scores}", ai=f"*{io}", T="i32"),
                 dict(HV=HV, BT=BT, BC=BC, DT=tl.float32, PREC=prec, IS_VARLEN=False, cu_seqlens=None,
                      chunk_indices=None, HEADS_FIRST=True), warps or chunk_wy.INVERSE_WARPS)
        compile_(chunk_wy.qed_scalar_wy_kernel,
                 dict(q=f"*{io}", k=f"*{io}", gc="*fp32", alpha="*fp32", gamma="*fp32", v=f"*{io}",
                      w_gate=f"*{io}", ai=f"*{io}", w=f"*{io}", u=f"*{io}", T="i32",
                      **({"rk": "*fp32"} if fold else {})),
                 dict(common, V=V, BKS=min(chunk_wy.SCALAR_WY_SLICE, K), BVS=min(chunk_wy.SCALAR_WY_SLICE, V),
                      DIR_SOURCE="q", W_HEAD=True, z=None, d_in=None, HEADS_FIRST=True,
                      **({} if fold else {"rk": None})),
                 warps or chunk_wy.WY_WARPS)
        for scans in (1 << 20, 64, 1):
            BV, nw, stages = state_config(K, V, dtype, scans=scans, sm_count=H200_SMS, row_decay=True)
            for output in (False, True):
                print(f"BV={BV:<3d} {'scan + output' if output else 'scan':13s}", end=" ")
                compile_state(io, prec, H, HV, K, V, BV, warps or nw, stages, row_decay=True, output=output,
                              fold=fold)
    for sd in ("residual", "patch") if probes else ("off",):
        BV, nw, stages = scalar_output_config(V, dtype, sd == "patch")
        print(f"SD={sd:<8s}", end=" ")
        compile_(qed_scalar_output_kernel,
                 dict(q=f"*{io}", k=f"*{io}", gc="*fp32", b=f"*{io}", lam="*fp32", v=f"*{io}", w=f"*{io}",
                      hs=f"*{io}", r=f"*{io}", o=f"*{io}", T="i32", scale="fp32", **(norms if fold else {}),
                      **opt(cp="*fp32", rho="*fp32", patch="*i8", sd="*fp32")),
                 dict(common, V=V, BK=triton.next_power_of_2(K), BV=BV, **FULL, SD=sd, FOLD_NORMS=fold,
                      LAM_TOKEN=False, W_HEAD=True, z=None, d_in=None, HEADS_FIRST=True,
                      **absent("cp", "rho", "patch", "sd"), **({} if fold else dict.fromkeys(norms))),
                 warps or nw, stages)


def backward(K: int, V: int, H: int = 16, warps: int | None = None, fp32: bool = False):
    """The backward's prep and its five kernels as ``chunk_bwd`` launches them for bf16 inputs
    (forward buffers bf16, float32 gradients and state) or, with ``fp32``, float32 inputs (tf32x3)."""
    io, prec = ("fp32", "tf32x3") if fp32 else ("bf16", "tf32")
    print(f"--- backward, {io} inputs, float32 state, K={K} V={V}")
    ptr = lambda names, t: {n: t for n in names.split()}  # noqa: E731
    common = dict(HV=H, K=K, V=V, BT=BT, DT=tl.float32, PREC=prec, IS_VARLEN=False, cu_seqlens=None)
    compile_prep(io, K, H, probes=False, hats=True, warps=warps)
    compile_(qed_dstate_kernel, dict(ptr("w kg qg aqk dh do", f"*{io}"), **ptr("gl dht dr dh0", "*fp32"), T="i32"),
             dict(common, BKP=min(STATE_BKP, K), BV=min(STATE_BV, V), WHILE_LOOP=False, USE_DHT=True,
                  chunk_offsets=None),
             warps or STATE_WARPS)
    compile_(qed_bwd_wy_kernel,
             dict(ptr("ai w u r hs dh do v w_gate", f"*{io}"), **ptr("dr dqg dkg dgl dag daqk dakk dv dw", "*fp32"),
                  T="i32"),
             dict(common, BKS=min(WY_BWD_BKS, K), BVS=min(WY_BWD_BVS, V), chunk_indices=None),
             warps or WY_BWD_WARPS)
    compile_(qed_prep_bwd_kernel,
             dict(q=f"*{io}", k=f"*{io}", b=f"*{io}", lam="*fp32", **ptr("rq rk cp gq gk ga dq dk db dlam", "*fp32"),
                  T="i32"),
             dict(H=H, HV=H, K=K, BT=BT, BKS=min(PREP_BWD_BKS, K), L2NORM=True, **FULL, DT=tl.float32,
                  LAM_TOKEN=False, IS_VARLEN=False, STORE_DD=False, z=None, d_in=None, dd=None, cu_seqlens=None,
                  chunk_indices=None),
             warps or PREP_BWD_WARPS)
    compile_(qed_bwd_scores_kernel,
             dict(ptr("gc qs kh a daqk dakk dqg dkg dag dq dk da dgc dgk", "*fp32"), T="i32", scale="fp32"),
             dict(HV=H, K=K, BT=BT, BC=BC, BKS=min(SCORES_BWD_BKS, K), IS_VARLEN=False, DT=tl.float32, PREC=prec,
                  cu_seqlens=None, chunk_indices=None),
             warps or SCORES_BWD_WARPS)
    compile_(qed_bwd_dg_kernel, dict(ptr("dgc dgk dgl gl dg", "*fp32"), T="i32"),
             dict(HV=H, K=K, BT=BT, BC=BC, BKS=min(DG_BWD_BKS, K), IS_VARLEN=False, DT=tl.float32,
                  cu_seqlens=None, chunk_indices=None),
             warps or DG_BWD_WARPS)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default="fwd", choices=("fwd", "bwd", "all"))
    ap.add_argument("--warps", type=int, default=None, help="compile every kernel at this many warps")
    ap.add_argument("--scores-bks", type=int, default=None, help="key slice of the scores kernel")
    ap.add_argument("--fp32", action="store_true", help="float32 inputs (tf32x3) instead of bf16")
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--head", action="store_true", help="the scalar-gate path (per-head g, b, w [B, T, HV])")
    ap.add_argument("--HV", type=int, default=32, help="value heads of the scalar-gate path (16 q/k heads)")
    ap.add_argument("--mix", action="store_true", help="also each kernel's SASS instruction mix")
    a = ap.parse_args()
    global show_mix
    show_mix = a.mix
    if a.what in ("fwd", "all"):
        for probes in (False, True):
            if a.head:
                scalar_forward(probes, a.K, a.V, HV=a.HV, warps=a.warps, fp32=a.fp32)
            else:
                forward(probes, a.K, a.V, warps=a.warps, scores_bks=a.scores_bks, fp32=a.fp32)
    if a.what in ("bwd", "all"):
        backward(a.K, a.V, warps=a.warps, fp32=a.fp32)


if __name__ == "__main__":
    main()
