"""Time ``qed_chunk`` under launch settings of its kernels, to screen warps, key and value slices for
speed: the forward with probes off and on and the forward + backward (bench/kernel_times.py's main
shape, B=8, T=4096, H=16, K=V=128, bf16), each with every ``qed_*`` kernel's time (torch.profiler,
ms per call). Correctness of the same settings is screened by ``scripts/h200_bwd_configs.sh``
(float64 reference) and the GPU tests.

    python scripts/config_timing.py [--set chunk_wy.INVERSE_WARPS=2 --set chunk_scan.OUTPUT_WARPS=4 ...]
        [--forward-only]

Run one process per setting (a launch that faults poisons the process's CUDA context;
``scripts/h200_screen.sh`` does so for a list of settings). Prints one ``timing`` line: the
settings, then per run its ms and the per-kernel ms. ``--forward-only`` leaves out the forward +
backward (it compiles the backward's kernels: most of a process's time).
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "bench")]
from chunk_bwd_localize import apply_settings  # noqa: E402
from kernel_times import GRAD_WRT, MAIN, fwd_bwd, inputs, kernel_ms, ms, qed_fn  # noqa: E402


def timed(name: str, fn) -> str:
    """``name ms [kernel=ms ...]`` of ``fn``'s ``qed_*`` kernels."""
    parts = {k.removeprefix("qed_").removesuffix("_kernel"): t for k, t in kernel_ms(fn).items() if k.startswith("qed_")}
    return f"{name} {ms(fn):.3f} [" + " ".join(f"{k}={t:.3f}" for k, t in sorted(parts.items())) + "]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    ap.add_argument("--forward-only", action="store_true", help="time the forward (probes off and on) only")
    a = ap.parse_args()
    apply_settings(a.set)
    x = inputs(**MAIN)
    runs = [timed("fwd", qed_fn(x)), timed("fwd+probes", qed_fn(x, probes=True))]
    if not a.forward_only:
        runs.append(timed("fwd+bwd", fwd_bwd(qed_fn, x, GRAD_WRT)))
    print(f"timing {' '.join(a.set) or 'defaults'}: " + " | ".join(runs))


if __name__ == "__main__":
    main()
