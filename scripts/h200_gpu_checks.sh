#!/usr/bin/env bash
# One device call: the kernel benchmark (bench/kernels.py: main shape, every arm, T = 1K..32K,
# forward + backward, decode; --dplr adds fla's chunk_dplr_delta_rule side by side), then the GPU
# tests of the kernels and of the CUDA-graph decode (against qed_naive and fla 0.6.0).
# Expects the wheel set in .whl_tl/ (see scripts/h200_model_checks.sh for how to build it):
#   run(command="bash scripts/h200_gpu_checks.sh", carry=[".whl_tl"])
# Environment: PARTS (default "bench tests"; one of them alone lets two calls, or two GPUs, split
# the work), BENCH_FLAGS (default "--dplr"), BENCH_SECONDS (default 330), TEST_SECONDS (default
# 200), TEST_FILES (default: the four kernel and decode test files, absolute paths), FLA_BWD=1 to
# include test_gpu_vs_fla_gdn2_backward (it did not finish within 2-4 minutes in two calls on
# 2026-11-30: fla autotunes its backward on the first call).
# The first GPU test of each kernel variant compiles it (tens of seconds each), so the tests
# need minutes; they run after the benchmark so that a short call still yields the timings.
# Logs go to $OUT (kernels.log and bench/kernels.py's table and JSON, gpu_tests.log).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -P -c "import qedprobe.kernels, transformer_lens, fla" 2>/dev/null || python3 -m pip install -q \
    --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$REPO"/.whl_tl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# From /tmp, so that the installed wheel (with qedprobe.kernels) is imported, not the source folder.
PARTS=${PARTS:-bench tests}
[[ " $PARTS " == *" bench "* ]] && cd /tmp && timeout "${BENCH_SECONDS:-330}" python3 "$REPO"/bench/kernels.py ${BENCH_FLAGS:---dplr} \
    --budget $(( ${BENCH_SECONDS:-330} - 40 )) 2>&1 | tee "$OUT/kernels.log" | tail -60
[[ " $PARTS " == *" tests "* ]] || exit 0
select="gpu or GPU or cuda_graph"
[[ ${FLA_BWD:-0} == 1 ]] || select="($select) and not test_gpu_vs_fla_gdn2_backward"
cd /tmp && timeout "${TEST_SECONDS:-200}" python3 -m pytest -v -p no:cacheprovider --rootdir /tmp -k "$select" \
    ${TEST_FILES:-"$REPO"/tests/test_chunk.py "$REPO"/tests/test_chunk_bwd.py \
    "$REPO"/tests/test_fused_recurrent.py "$REPO"/tests/test_decode_fast.py} 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASS|FAIL|ERROR|passed|failed" | tail -40
