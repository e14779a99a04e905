"""Time the ``qed_chunk`` forward + backward (bench/kernels.py's main shape, B=8, T=4096, H=16,
K=V=128, bf16) under launch settings of the backward kernels, and the backward scores kernel and its
``dg`` kernel alone (torch.profiler, ms per call), to screen its warps and key slice for speed; correctness of the same
settings is screened by ``scripts/h200_bwd_configs.sh`` (float64 reference).

    python scripts/bwd_config_timing.py [--set chunk_bwd_intra.SCORES_BWD_WARPS=4 ...]

Prints one ``timing`` line: the settings, the forward + backward ms and the two kernels' ms per call.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "bench")]
from chunk_bwd_localize import apply_settings  # noqa: E402
from kernels import GRAD_WRT, MAIN, fwd_bwd, inputs, kernel_ms, ms, qed_fn  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    a = ap.parse_args()
    apply_settings(a.set)
    x = inputs(MAIN["B"], MAIN["T"], MAIN["H"], MAIN["HV"], MAIN["K"], MAIN["V"])
    step = fwd_bwd(qed_fn, x, GRAD_WRT)
    total = ms(step)
    per = kernel_ms(step)
    parts = ", ".join(f"{name} {sum(t for key, t in per.items() if key.startswith(name)):.3f} ms"
                      for name in ("qed_bwd_scores_kernel", "qed_bwd_dg_kernel"))
    print(f"timing {' '.join(a.set) or 'defaults'}: fwd+bwd {total:.3f} ms, {parts}")


if __name__ == "__main__":
    main()
