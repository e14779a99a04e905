#!/usr/bin/env bash
# One device call: the GPU tests of the kernels (forward, backward, decode; against qed_naive and
# fla 0.6.0), then the kernel benchmark (bench/kernels.py: main shape, every arm, T = 1K..32K,
# forward + backward, decode; --dplr adds fla's chunk_dplr_delta_rule side by side).
# Expects the wheel set in .whl_tl/ (see bench/h200_model_checks.sh for how to build it):
#   run(command="bash bench/h200_gpu_checks.sh", carry=[".whl_tl"])
# Environment: BENCH_FLAGS (default "--dplr"), BENCH_SECONDS (default 330).
# Logs go to $OUT (gpu_tests.log, kernels.log and bench/kernels.py's table and JSON).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -P -c "import qedprobe.kernels, transformer_lens, fla" 2>/dev/null || python3 -m pip install -q \
    --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$REPO"/.whl_tl/*.whl || exit 1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# From /tmp, so that the installed wheel (with qedprobe.kernels) is imported, not the source folder.
cd /tmp && python3 -m pytest -q -p no:cacheprovider --rootdir /tmp -k "gpu or GPU" \
    "$REPO"/tests/test_chunk.py "$REPO"/tests/test_chunk_bwd.py "$REPO"/tests/test_fused_recurrent.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -25
cd /tmp && timeout "${BENCH_SECONDS:-330}" python3 "$REPO"/bench/kernels.py ${BENCH_FLAGS:---dplr} \
    --budget $(( ${BENCH_SECONDS:-330} - 40 )) 2>&1 | tee "$OUT/kernels.log" | tail -60
