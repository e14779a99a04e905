"""One device call for qed_chunk: main-shape timings, the GPU tests, then the sweeps, in one
process (compiled kernels and fla's autotuning are shared), inside a wall-clock budget.

    PYTHONUNBUFFERED=1 python3 bench/chunk_device_run.py [BUDGET_S] [FLA_MS] [FLA_FWD_BWD_MS]

Logs and the markdown table go to $OUT (bench/kernels.py writes kernels_bench.md / .json).
"""
import os
import runpy
import sys
import time

import pytest

R = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET = float(sys.argv[1]) if len(sys.argv) > 1 else 200.0
FLA_MS = sys.argv[2] if len(sys.argv) > 2 else "2.014"
FLA_FB_MS = sys.argv[3] if len(sys.argv) > 3 else "11.25"
T0 = time.time()


def left():
    return BUDGET - (time.time() - T0)


def bench(args):
    sys.argv = ["kernels.py"] + args
    try:
        runpy.run_path(os.path.join(R, "bench", "kernels.py"), run_name="__main__")
    except SystemExit:
        pass


def tests(name, sel, timeout):
    pytest.main(["-q", "-s", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=short", "--timeout", str(timeout),
                 os.path.join(R, "tests", name), "-k", sel, "--durations=10"])


print(f"== main shape (fla time {FLA_MS} ms from an earlier run on this device)", flush=True)
bench(["--quick", "--no-fla", "--parts", "--fla-ms", FLA_MS, "--fla-fb-ms", FLA_FB_MS])
print(f"== tests, {left():.0f} s left", flush=True)
sel = "gpu_long and full or gpu_float64 or strong"
if left() > 150:
    sel += " or gpu_vs_fla"
tests("test_chunk.py", sel, 120)
print(f"== backward tests, {left():.0f} s left", flush=True)
sel = "gpu_long or gpu_float64 or strong or varlen" + (" or gpu_vs_fla" if left() > 150 else "")
tests("test_chunk_bwd.py", sel, 180)
print(f"== sweeps, {left():.0f} s left", flush=True)
if left() > 30:
    bench(["--no-fla", "--fla-ms", FLA_MS, "--budget", str(left() - 5)])
print(f"== done in {time.time() - T0:.0f} s", flush=True)
