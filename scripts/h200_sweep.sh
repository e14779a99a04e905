#!/usr/bin/env bash
# The Table-4 sweep grid of the 340M shape on one H200 (issue: full grid <= 600 s), in at most two
# device calls: call 1 runs the GPU tests of the fast path and the decode graphs, the profile of one
# 32K batch (plain and fast path, bench/profile_sweep.py) and the grid until its budget ends; call 2
# (PARTS=grid) resumes the grid (bench/sweep.py sums the calls' wall time) until it is complete.
#
# Wheels: `bash scripts/device_wheels.sh` here first (after every change).
# The calls:
#   run(command="bash scripts/h200_sweep.sh", carry=[".whl"], timeout_s=600)
#   run(command="PARTS=grid bash scripts/h200_sweep.sh", carry=[".whl"], timeout_s=600)
# To time the whole grid in one uninterrupted call instead: PARTS=grid first (it stops at its budget
# if it cannot finish, and a second PARTS=grid call completes it), then PARTS="tests profile".
# The grid folder and inductor's cache live in .sweep_cache/ (git-ignored), which a warm machine keeps
# between calls; on a fresh machine copy $OUT/grid/* of call 1 to .sweep_cache/grid/ here and add
# ".sweep_cache" to carry.
# Environment: PARTS (default "tests profile grid"), CALL_SECONDS (default 590: this call's wall budget,
# the grid gets what the other parts left), COMMIT (default: .whl/BUILD, written by scripts/device_wheels.sh).
# Output in $OUT: gpu_tests.log, profile.log, profile.json, sweep.log, sweep.json (keep it as
# docs/benchmarks/sweep.json once full_grid is true), grid/ (the sweep folder's small files).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export OUT=${OUT:-/tmp/out}
export TORCHINDUCTOR_CACHE_DIR="$REPO/.sweep_cache/inductor"
mkdir -p "$OUT" "$REPO/.sweep_cache"
source "$REPO/scripts/device_env.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
COMMIT=${COMMIT:-$(cat "$REPO/.whl/BUILD" 2>/dev/null || echo unknown)}
PARTS=${PARTS:-tests profile grid}
CALL_SECONDS=${CALL_SECONDS:-590}
# From /tmp, so that the installed wheel (with qedprobe.kernels) is imported, not the source folder.
cd /tmp
if [[ " $PARTS " == *" tests "* ]]; then
    timeout 150 python3 -m pytest -v -p no:cacheprovider --rootdir /tmp -k "gpu or cuda_graph" \
        "$REPO"/tests/test_fast_path.py "$REPO"/tests/test_decode_fast.py \
        2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASS|FAIL|ERROR|passed|failed" | tail -20
fi
if [[ " $PARTS " == *" profile "* ]]; then
    timeout 200 python3 "$REPO"/bench/profile_sweep.py --length 32768 --steps 10 --top 30 \
        2>&1 | tee "$OUT/profile.log" | grep -E "^\{|===" | tail -8
    tail -1 "$OUT/profile.log" > "$OUT/profile.json"
fi
if [[ " $PARTS " == *" grid "* ]]; then
    budget=$(( CALL_SECONDS - SECONDS - 10 ))
    echo "grid budget ${budget} s"
    timeout $(( budget + 5 )) python3 "$REPO"/bench/sweep.py --out "$REPO/.sweep_cache/grid" --budget "$budget" \
        --json "$OUT/sweep.json" --commit "$COMMIT" --no-progress 2>&1 | tee "$OUT/sweep.log" | tail -45
    mkdir -p "$OUT/grid"
    cp "$REPO"/.sweep_cache/grid/{results.jsonl,config.json,bench_timing.json,summary.json} "$OUT/grid/" 2>/dev/null
fi
