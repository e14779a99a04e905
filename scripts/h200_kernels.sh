#!/usr/bin/env bash
# One device call for the kernels: the GPU tests of qed_chunk / qed_recurrent and of the CUDA-graph
# decode, then the
# benchmark (bench/kernels.py: fla's forward+backward first, the order-independence check,
# T 1K-32K, probes on/off, every arm, grouped heads, forward+backward, decode).
#
# Wheels: `bash scripts/device_wheels.sh` here (after every change), then
#   run(command="bash scripts/h200_kernels.sh", carry=[".whl"])
# Environment: PARTS (default "tests bench"), TEST_SECONDS (default 240), BENCH_SECONDS (default 330),
# FLA_BWD=1 to include test_gpu_vs_fla_gdn2_backward (fla autotunes its backward for minutes),
# COMMIT (the commit the wheel was built from; default: this checkout's HEAD when it has .git).
# Output in $OUT: gpu_tests.log, kernels.log and kernels.json (keep it under docs/results/<date>/).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$REPO/scripts/device_env.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
COMMIT=${COMMIT:-$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)}
PARTS=${PARTS:-tests bench}
# From /tmp, so that the installed wheel (with qedprobe.kernels) is imported, not the source folder.
cd /tmp
if [[ " $PARTS " == *" tests "* ]]; then
    select="gpu or GPU or cuda_graph"
    [[ ${FLA_BWD:-0} == 1 ]] || select="($select) and not test_gpu_vs_fla_gdn2_backward"
    timeout "${TEST_SECONDS:-240}" python3 -m pytest -v -p no:cacheprovider --rootdir /tmp -k "$select" \
        "$REPO"/tests/test_chunk.py "$REPO"/tests/test_chunk_bwd.py "$REPO"/tests/test_fused_recurrent.py "$REPO"/tests/test_decode_fast.py \
        2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASS|FAIL|ERROR|passed|failed" | tail -40
fi
if [[ " $PARTS " == *" bench "* ]]; then
    timeout "${BENCH_SECONDS:-330}" python3 "$REPO"/bench/kernels.py --json "$OUT/kernels.json" --commit "$COMMIT" \
        --budget $(( ${BENCH_SECONDS:-330} - 30 )) 2>&1 | tee "$OUT/kernels.log" | tail -60
fi
