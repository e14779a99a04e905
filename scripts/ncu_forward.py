"""One forward of ``qed_chunk`` (probes off, then on) and of fla's ``chunk_gdn2`` at the kernel
benchmark's main shape (B=8, T=4096, H=16, K=V=128, bf16) inside a CUDA profiler range, for Nsight
Compute to read each kernel's hardware counters (DRAM bytes and throughput, occupancy, warp
stalls): where the prep kernel's bandwidth goes, against fla's norm and cumsum kernels.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
        python3 scripts/ncu_forward.py [--no-fla]

Every kernel runs once first (compiles, fla's autotuning of its forward), outside the range.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))
from kernel_times import DEV, MAIN, fla_fn, qed_fn  # noqa: E402
from layer_inputs import per_channel_inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-fla", action="store_true", help="profile qed_chunk only")
    a = ap.parse_args()
    x = per_channel_inputs(**MAIN, device=DEV)
    runs = [qed_fn(x), qed_fn(x, probes=True)] + ([] if a.no_fla else [fla_fn(x)])
    for fn in runs:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn in runs:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
