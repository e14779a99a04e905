#!/usr/bin/env bash
# One device call that screens launch settings of the qed_chunk kernels: scripts/config_timing.py
# once per setting, each in its own process (a kernel fault poisons a process's CUDA context), the
# defaults first; then, with TESTS=1, the GPU tests of the chunked forward and backward.
#   SETS="chunk_intra.PREP_WARPS=8;chunk_intra.PREP_BKS=64 chunk_intra.SCORES_WARPS=8" \
#     bash scripts/h200_screen.sh                      (carry ".whl")
# Environment: SETS (";"-separated settings, each one or more space-separated MODULE.NAME=VALUE),
# FORWARD_ONLY (default 1: the forward with probes off and on; 0 adds the forward + backward),
# SET_SECONDS (default 90 per process), TESTS (default 0), TEST_SECONDS (default 240).
# Wheels: `bash scripts/device_wheels.sh` here first. Output in $OUT: screen.txt (one "timing"
# line per setting), gpu_tests.log with TESTS=1.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$REPO/scripts/device_env.sh" || exit 1
flag=""
[[ ${FORWARD_ONLY:-1} == 1 ]] && flag="--forward-only"
# From /tmp, so that the installed wheel (with qedprobe.kernels) is imported, not the source folder.
cd /tmp
IFS=';' read -ra sets <<< ";${SETS:-}"
for s in "${sets[@]}"; do
    args=()
    for item in $s; do args+=(--set "$item"); done
    timeout "${SET_SECONDS:-90}" python3 "$REPO"/scripts/config_timing.py $flag "${args[@]}" 2>&1 \
        | grep -E "^timing|Error" | tail -2 || echo "timing $s: no result (timed out or faulted)"
done | tee "$OUT/screen.txt"
if [[ ${TESTS:-0} == 1 ]]; then
    timeout "${TEST_SECONDS:-240}" python3 -m pytest -q -p no:cacheprovider --rootdir /tmp -k "gpu or GPU" \
        "$REPO"/tests/test_chunk.py "$REPO"/tests/test_chunk_bwd.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
fi
