"""Compile qed_chunk's kernels for sm_90 on a machine without a GPU (Triton's AOT path and the
ptxas its wheel carries) and print shared memory, registers and spills per kernel.

    python bench/chunk_aot.py main|warps|scan|intra|fp32|fp64|wrapper|f64k256|k256|bwd

The intra step is two kernels: ``qed_prep_kernel`` and the autotuned ``qed_solve_kernel``
(compiled here at each of its configs' warp counts, or at ``W`` when given).

It reproduced the device's shared-memory figure (294912 B for the float32 scan with two stages)
exactly, so configurations can be screened here before spending device time.
"""
import sys, time, inspect
import triton, triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from qedprobe.kernels.qed.chunk import INTRA_CONFIG
from qedprobe.kernels.qed.chunk_intra import qed_prep_kernel, qed_solve_kernel
from qedprobe.kernels.qed.chunk_scan import qed_scan_kernel
from qedprobe.kernels.qed.chunk_bwd import DSTATE_CONFIG, INTRA_BWD_CONFIG
from qedprobe.kernels.qed.chunk_bwd_intra import qed_intra_bwd_kernel
from qedprobe.kernels.qed.chunk_bwd_scan import qed_dstate_kernel
TGT = GPUTarget("cuda", 90, 32)

def compile_(kern, ptrs, scalars, consts, num_warps, num_stages):
    kern = kern.fn if isinstance(kern, triton.runtime.Autotuner) else kern
    fn = kern.fn if hasattr(kern, "fn") else kern
    names = list(inspect.signature(fn).parameters)
    sig = {}
    for n in names:
        if n in consts: sig[n] = "constexpr"
        elif n in ptrs: sig[n] = ptrs[n]
        elif n in scalars: sig[n] = scalars[n]
        else: raise KeyError(n)
    src = ASTSource(fn=kern, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    t = time.time()
    k = triton.compile(src, target=TGT, options=dict(num_warps=num_warps, num_stages=num_stages))
    md = k.metadata
    import subprocess, tempfile, os, re
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    r = subprocess.run([ptxas, "--gpu-name", "sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    info = " ".join(l.strip() for l in r.stderr.splitlines() if "Used" in l or "spill" in l)
    info = re.sub(r"\s+", " ", info)
    print(f"{fn.__name__:18s} warps {num_warps} stages {num_stages}: shared {md.shared} B, compile {time.time()-t:.1f}s | {info}", flush=True)
    return k

def run(dt_in="bf16", ct="fp32", probes=True, K=128, V=128, H=16, inter=None, prec="tf32", impl="fused", stages=None, W=None, BKS_=32, BVx=None):
    inter = inter or (dt_in if dt_in == "bf16" else ct)
    DT = tl.float32 if ct == "fp32" else tl.float64
    print(f"--- inputs {dt_in}, compute {ct}, inter {inter}, probes {probes}, K={K} V={V}")
    BKS = min(BKS_, triton.next_power_of_2(K)); BVS = min(64, triton.next_power_of_2(V))
    NK = triton.cdiv(K, BKS); NV = triton.cdiv(V, BVS)
    P = lambda t: "*" + t
    common_c = dict(H=H, K=K, BT=64, BKS=BKS, NK=NK, IS_VARLEN=False, DT=DT, ARM=3, LAM_TOKEN=False, PROBES=probes)
    inp = {n: P(dt_in) for n in "q k v b w".split()}
    inp.update(g=P("fp32"), lam=P(ct), z=P(ct), d_in=P(dt_in), cu_seqlens=P("i32"), chunk_indices=P("i32"))
    outs = {n: P(inter) for n in "W U KG QG DG AQK ADK".split()}
    outs.update({n: P(ct) for n in "AKK GL RHO EIG DPR GC RQ RK CP".split()})
    sc = dict(T="i32", scale="fp32")
    if impl == "fused":
        PB = min(INTRA_CONFIG["prep_BKS"], triton.next_power_of_2(K))
        compile_(qed_prep_kernel, {**inp, **outs}, sc, dict(common_c, L2NORM=True, BKS=PB, NK=triton.cdiv(K, PB)),
                 INTRA_CONFIG["prep_warps"], 1)
        for nw in ([W] if W else [c.num_warps for c in qed_solve_kernel.configs]):
            compile_(qed_solve_kernel, {**inp, **outs}, sc,
                     dict(common_c, V=V, BC=16, BVS=BVS, NV=NV, PREC=prec, SPAN=30.0), nw, 1)
    BK = triton.next_power_of_2(K)
    BV = BVx or (64 if (BK <= 128 and ct != "fp64") else 32)
    st = stages if stages is not None else (2 if (inter == "bf16" and BK <= 128) else 1)
    scan_p = {n: P(inter) for n in "W U KG QG DG AQK ADK".split()}
    scan_p.update(GL=P(ct), H0=P(ct), O=P(dt_in), SD=P(ct), HT=P(ct), HS=P(ct), cu_seqlens=P("i32"), chunk_offsets=P("i32"))
    compile_(qed_scan_kernel, scan_p, dict(T="i32"), dict(H=H, K=K, V=V, BT=64, BK=BK, BV=min(BV, triton.next_power_of_2(V)),
             USE_H0=True, STORE_HT=True, IS_VARLEN=False, PROBES=probes, STORE_STATES=False, DT=DT, PREC=prec, WHILE_LOOP=False),
             W or (4 if BK <= 128 else 8), st)

def run_bwd(ct="fp32", K=128, V=128, H=16, prec="tf32x3", W=None, BVx=None):
    """The two backward kernels as chunk_bwd.core_backward launches them (state dtype ``ct``)."""
    DT = tl.float32 if ct == "fp32" else tl.float64
    print(f"--- backward, state dtype {ct}, K={K} V={V}")
    BK = triton.next_power_of_2(K)
    BV = BVx or min(DSTATE_CONFIG["BV"], triton.next_power_of_2(V))
    ptr = lambda names: {n: "*" + ct for n in names.split()}  # noqa: E731
    sp = ptr("W U KG QG AQK GL HS DO DHT DU RS DH DH0")
    sp.update(cu_seqlens="*i32", chunk_offsets="*i32")
    compile_(qed_dstate_kernel, sp, dict(T="i32"),
             dict(H=H, K=K, V=V, BT=64, BK=BK, BV=BV, USE_DHT=True, IS_VARLEN=False, DT=DT, PREC=prec,
                  WHILE_LOOP=False), W or DSTATE_CONFIG["num_warps"], 1)
    BKS, BVS = min(INTRA_BWD_CONFIG["BKS"], BK), min(INTRA_BWD_CONFIG["BVS"], triton.next_power_of_2(V))
    ip = ptr("QH KH A AKK W U HS DO DU RS DH DQG DKG DGL DAQK DQ DK DA DG DWV")
    ip.update(g="*fp32", cu_seqlens="*i32", chunk_indices="*i32")
    compile_(qed_intra_bwd_kernel, ip, dict(T="i32", scale="fp32"),
             dict(H=H, K=K, V=V, BT=64, BC=16, BKS=BKS, BVS=BVS, NK=triton.cdiv(K, BKS), NV=triton.cdiv(V, BVS),
                  IS_VARLEN=False, DT=DT, PREC=prec), W or INTRA_BWD_CONFIG["num_warps"], 1)

if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "main"
    if what == "main":
        run("bf16", "fp32", probes=False)
        run("bf16", "fp32", probes=True)
    elif what == "fp32":
        run("fp32", "fp32", probes=True, prec="tf32x3", W=8)
        run("fp32", "fp32", probes=True, prec="tf32x3", impl="none", stages=2)
    elif what == "fp64":
        run("fp64", "fp64", probes=True, prec="ieee", W=8)
    elif what == "warps":
        for W in (8, 2):
            run("bf16", "fp32", probes=True, W=W)
    elif what == "scan":
        for W in (4, 8):
            for st in (1, 2):
                for BVx in (32, 64):
                    print("scan BV", BVx); run("bf16", "fp32", probes=True, W=W, impl="none", stages=st, BVx=BVx)
    elif what == "intra":
        for W in (8,):
            for B_ in (16, 64):
                print("intra BKS", B_); run("bf16", "fp32", probes=True, W=W, impl="fused", BKS_=B_)
    elif what == "wrapper":
        run("fp32", "fp32", probes=True, prec="tf32x3", impl="none")
        run("fp64", "fp64", probes=True, prec="ieee", impl="none")
        run("bf16", "fp32", probes=True, K=256, V=256, impl="none")
        run("fp64", "fp64", probes=True, prec="ieee", K=256, V=256, impl="none")
        run("fp32", "fp32", probes=True, prec="tf32x3", K=256, V=256, impl="none")
    elif what == "f64k256":
        run("fp64", "fp64", probes=True, prec="ieee", K=256, V=256, impl="none", BVx=16)
        run("fp64", "fp64", probes=True, prec="ieee", K=256, V=256, impl="none", BVx=16, W=4)
    elif what == "k256":
        run("bf16", "fp32", probes=True, K=256, V=256, W=8)
        run("bf16", "fp32", probes=False, K=64, V=64, W=8)
    elif what == "bwd":
        run_bwd("fp32", 128, 128)
        run_bwd("fp32", 256, 256)
        run_bwd("fp64", 64, 64, prec="ieee")
        run_bwd("fp64", 128, 128, prec="ieee")
