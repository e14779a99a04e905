"""qed_chunk forward, this tree's kernels against an older copy, with a per-kernel breakdown (CUDA).

Both versions are loaded by path (``kernels/qed`` here, ``OLD_DIR`` for the other one), so no
installed ``qedprobe`` is needed and the two do not shadow each other. To time against main at
ff8b1b8 (one intra kernel), make the old copy in the checkout first (untracked files travel to
the device machine), then make one device call:

    git archive ff8b1b8 kernels/qed | tar -x -C /tmp && rm -rf bench/old && cp -r /tmp/kernels/qed bench/old
    PYTHONUNBUFFERED=1 python3 bench/intra_compare.py bench/old          # the device call
    rm -rf bench/old

Rows (median of ``triton.testing.do_bench``; shape B=8, T=4096, H=16, K=V=128, bf16 inputs,
float32 log-decay, arm ``full``, as ``bench/kernels.py``): old / new forward with probes off and
on, fla ``chunk_gdn2`` when importable, then per kernel (torch.profiler, 5 calls: the intra
kernel(s) and the scan kernel) for each, and the largest old / new differences of ``o`` and the
final state (bf16 run and a float32 run, T=1024) as a correctness check. Writes
``intra_compare.md`` / ``.json`` to ``$OUT`` when set.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch
from triton.testing import do_bench

HERE = os.path.dirname(os.path.abspath(__file__))


def load(path: str, name: str):
    """Import the package at ``path`` (a copy of ``kernels/qed``) as ``name``."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def inputs(B, T, H, K, V, dtype, seed=0):
    torch.manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=dtype)  # noqa: E731
    u = lambda *s: torch.rand(*s, device="cuda", dtype=dtype)  # noqa: E731
    return {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, H, V) * 0.5,
            "g": -torch.rand(B, T, H, K, device="cuda") * 0.1, "b": u(B, T, H, K), "w": u(B, T, H, V),
            "lam": 0.1 * torch.ones(H, device="cuda")}


def call(mod, x, probes=False, final=False):
    return lambda: mod.qed_chunk(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], x["lam"], arm="full",
                                 return_probes=probes, output_final_state=final)


def per_kernel(fn, calls=5):
    """``{kernel name: ms per call}`` from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            out[e.key] = t / 1e3 / calls
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/intra_compare.py needs CUDA")
        return 1
    old_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "old")
    new = load(os.path.join(os.path.dirname(HERE), "kernels", "qed"), "qed_new")
    old = load(old_dir, "qed_old") if os.path.exists(os.path.join(old_dir, "__init__.py")) else None
    if old is None:
        print(f"no old copy at {old_dir}: timing this tree only")
    rows = []

    def row(name, ms, note=""):
        rows.append({"name": name, "ms": ms, "note": note})
        print(f"{name:44s} {ms:8.3f} ms {note}", flush=True)

    x = inputs(8, 4096, 16, 128, 128, torch.bfloat16)
    versions = [("new", new)] + ([("old", old)] if old else [])
    for tag, mod in versions:
        call(mod, x)()
        call(mod, x, probes=True)()  # compile (and autotune) first
        torch.cuda.synchronize()
        row(f"qed_chunk fwd {tag}", do_bench(call(mod, x), warmup=25, rep=100, return_mode="median"))
        row(f"qed_chunk fwd {tag} + probes", do_bench(call(mod, x, True), warmup=25, rep=100, return_mode="median"))
    try:
        from fla.ops.gdn2 import chunk_gdn2
        def f():
            return chunk_gdn2(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], use_qk_l2norm_in_kernel=True)
        f()
        row("fla chunk_gdn2 fwd", do_bench(f, warmup=25, rep=100, return_mode="median"))
    except ImportError:
        pass
    for tag, mod in versions:
        for probes in (False, True):
            for name, ms in sorted(per_kernel(call(mod, x, probes)).items(), key=lambda kv: -kv[1]):
                row(f"  {tag}{' +probes' if probes else ''}: {name[:40]}", ms, "(per call)")
    if old:
        for dt in (torch.bfloat16, torch.float32):
            y = inputs(2, 1024, 4, 128, 128, dt, seed=1)
            o1, s1, _ = call(new, y, final=True)()
            o2, s2, _ = call(old, y, final=True)()
            print(f"{dt}: max |o_new - o_old| {(o1.float() - o2.float()).abs().max().item():.3e} "
                  f"(max |o| {o2.float().abs().max().item():.3e}), "
                  f"max |S_new - S_old| {(s1 - s2).abs().max().item():.3e}", flush=True)
    table = "\n".join(["| row | ms |", "|---|---|"]
                      + [f"| {r['name'].strip()} {r['note']} | {r['ms']:.3f} |" for r in rows])
    print(table)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "intra_compare.md"), "w") as fh:
            fh.write(f"device: {torch.cuda.get_device_name()}\n\n{table}\n")
        with open(os.path.join(out, "intra_compare.json"), "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
