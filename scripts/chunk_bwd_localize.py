"""Run the ``qed_chunk`` backward launch by launch, synchronising after each, and say which one
fails (a device fault surfaces at the next CUDA call, so the autograd traceback names the wrong
kernel). On success, compare every gradient with autograd through float64 ``qed_naive``.

    python scripts/chunk_bwd_localize.py [--dtype float32|bfloat16] [--T 2048] [--H 2] [--K 128] [--V 128] \
        [--set chunk_bwd_intra.WY_BWD_WARPS=4 ...]

``--set MODULE.NAME=VALUE`` overrides a launch constant of ``qedprobe.kernels.qed.MODULE`` (block
sizes, warps) before anything runs, to screen configurations for a compiler fault. Needs a GPU (or
``TRITON_INTERPRET=1`` on CPU, with small sizes). Prints one line per launch, then one ``summary``
line: the settings, the dtype and the largest relative gradient error.
"""
from __future__ import annotations

import argparse
import importlib

import torch

from qedprobe.kernels.qed import qed_naive
from qedprobe.kernels.qed.chunk import (chunk_intra_fwd, chunk_intra_recompute, chunk_precision, direction_inputs,
                                        run_scan)
from qedprobe.kernels.qed.chunk_bwd_intra import chunk_bwd_scores, chunk_bwd_wy
from qedprobe.kernels.qed.chunk_bwd_prep import chunk_prep_bwd
from qedprobe.kernels.qed.chunk_bwd_scan import chunk_bwd_state
from qedprobe.kernels.qed.chunk_common import chunk_layout
from qedprobe.kernels.qed.inputs import check_qed_inputs

NAMES = ("q", "k", "v", "g", "b", "w", "lam")


def _step(name, fn):
    """Run ``fn`` and synchronise; print where it failed."""
    try:
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception as err:  # report the launch, then stop
        print(f"FAILED at {name}: {type(err).__name__}: {err}", flush=True)
        raise
    print(f"ok: {name}", flush=True)
    return out


def apply_settings(settings) -> None:
    """``MODULE.NAME=VALUE`` -> ``qedprobe.kernels.qed.MODULE.NAME = int(VALUE)`` (the module must have NAME)."""
    for item in settings:
        target, _, value = item.partition("=")
        module_name, _, name = target.rpartition(".")
        module = importlib.import_module(f"qedprobe.kernels.qed.{module_name}")
        if not hasattr(module, name) or not value:
            raise SystemExit(f"--set: {item!r} must be MODULE.NAME=VALUE with NAME a constant of that module")
        setattr(module, name, int(value))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--H", type=int, default=2)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    a = ap.parse_args()
    apply_settings(a.set)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, a.dtype)
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    B, T, H, K, V = 1, a.T, a.H, a.K, a.V
    x64 = dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, H, V),
               g=-0.1 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64),
               b=torch.rand(B, T, H, K, generator=gen, dtype=torch.float64),
               w=torch.rand(B, T, H, V, generator=gen, dtype=torch.float64), lam=torch.full((H,), 0.1, dtype=torch.float64))
    x = {n: (t.float() if n == "g" else t.to(dt)).to(dev) for n, t in x64.items()}
    h0 = rnd(B, H, K, V).float().to(dev)
    do = rnd(B, T, H, V).to(device=dev, dtype=dt)
    dht = rnd(B, H, K, V).float().to(dev)
    args = [x[n] for n in NAMES]
    P = check_qed_inputs("qed_chunk", *args, arm="full", z=None, d=None, scale=None, initial_state=h0, cu_seqlens=None)
    inter, prec = chunk_precision(P, *(x[n] for n in ("q", "k", "v", "b", "w")))
    lay = chunk_layout(P, None, x["q"].device, prec)
    xi = direction_inputs(P, x["q"], x["k"], x["b"], x["lam"], "full", None, None, True)
    fwd = _step("forward intra (prep, scores, inverse, W/U)",
                lambda: chunk_intra_fwd(xi, x["v"], x["w"], x["g"], scale=P.scale, lay=lay, inter=inter, probes=False))
    intra = _step("recompute (prep, W/U)", lambda: chunk_intra_recompute(
        xi, x["v"], x["w"], x["g"], fwd.aqk, fwd.ai, scale=P.scale, lay=lay, inter=inter))
    states, r = _step("state scan (chunk-start states, residuals)", lambda: run_scan(P, lay, intra, h0=h0))
    dh = torch.empty_like(states)
    dr = torch.empty(B, T, H, V, device=dev, dtype=lay.state_dtype)
    dh0 = torch.empty(B, H, K, V, device=dev, dtype=lay.state_dtype)
    wy, prep = intra.wy, intra.prep
    _step("qed_dstate_kernel", lambda: chunk_bwd_state(lay, w=wy.w, kg=prep.kg, qg=prep.qg, aqk=intra.aqk, gl=prep.gl,
                                                        do=do, dht=dht, dh=dh, dr=dr, dh0=dh0, T=T, N=B))
    wg = _step("qed_bwd_wy_kernel", lambda: chunk_bwd_wy(lay, ai=intra.ai, w=wy.w, u=wy.u, r=r, hs=states, dh=dh,
                                                           do=do, dr=dr, v=x["v"], w_gate=x["w"]))
    dq_hat, dk_hat, da, dg = _step("qed_bwd_scores_kernel, qed_bwd_dg_kernel", lambda: chunk_bwd_scores(
        lay, prep, g=x["g"], wy_grads=wg, scale=P.scale))
    dq, dk, db, _dd, dlam = _step("qed_prep_bwd_kernel", lambda: chunk_prep_bwd(
        xi, lay, rq=prep.rq, rk=prep.rk, cp=prep.cp, gq=dq_hat, gk=dk_hat, ga=da))
    got = (dq, dk, wg.dv, dg, db, wg.dw, dlam.sum((0, 1)), dh0)
    leaves = [t.detach().double().requires_grad_(True) for t in (*args, h0)]
    o, s, _ = qed_naive(*leaves[:7], initial_state=leaves[7], output_final_state=True)
    ref = torch.autograd.grad((o * do.double()).sum() + (s * dht.double()).sum(), leaves)
    errs = {}
    for n, gr, rf in zip((*NAMES, "h0"), got, ref):
        errs[n] = ((gr.double() - rf).norm() / rf.norm().clamp_min(1e-30)).item()
        print(f"d{n}: rel err {errs[n]:.2e}")
    worst = max(errs, key=errs.get)
    print(f"summary {' '.join(a.set) or 'defaults'} {a.dtype}: largest rel err {errs[worst]:.2e} (d{worst})")


if __name__ == "__main__":
    main()
