#!/usr/bin/env bash
# One device call for the kernels: the GPU tests of qed_chunk / qed_recurrent and of the CUDA-graph
# decode, then the
# benchmark (bench/kernel_times.py: fla's forward+backward first, the order-independence check,
# T 1K-32K, probes on/off, every arm, grouped heads, forward+backward, decode).
#
# Wheels: `bash scripts/device_wheels.sh` here (after every change), then
#   run(command="bash scripts/h200_kernels.sh", carry=[".whl"])
# Environment: PARTS (default "tests bench"; "fault": the backward tests FAULT_K names, each alone
# (under compute-sanitizer's memcheck where the machine has it); "traffic": per-kernel times joined with the byte model of
# bench/forward_traffic.py, and scripts/scan_configs.py; "scans": scripts/scan_configs.py at T = 4K, 8K, 16K, 32K with
# 32K tokens each, one process a shape (the output kernel's settings at 4K only); "ncu": Nsight Compute's counters for every kernel of one qed_chunk forward,
# probes off and on, and of fla's, scripts/ncu_forward.py; "versions": scripts/h200_kernel_versions.sh on the trees
# scripts/kernel_trees.sh made, carried as .trees), TEST_SECONDS (default 360; the whole set needs about 300 s), BENCH_SECONDS (default 330),
# FLA_BWD=1 to include test_gpu_vs_fla_gdn2_backward (fla autotunes its backward for minutes),
# COMMIT (the commit the wheel was built from; default: .whl/BUILD, written by scripts/device_wheels.sh).
# Output in $OUT: gpu_tests.log (gpu_faults.log: the tests that hit a kernel fault, rerun alone),
# kernels.log and kernels.json (keep it under docs/results/<date>/); with "traffic" kernels_parts.json,
# forward_traffic.md, scan_configs.json.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$REPO/scripts/device_env.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
COMMIT=${COMMIT:-$(cat "$REPO/.whl/BUILD" 2>/dev/null || echo unknown)}
PARTS=${PARTS:-tests bench}
# From /tmp, so that the installed wheel (with qedprobe.kernels) is imported, not the source folder.
cd /tmp
TEST_FILES=("$REPO"/tests/test_chunk.py "$REPO"/tests/test_chunk_bwd.py "$REPO"/tests/test_fused_recurrent.py "$REPO"/tests/test_decode_fast.py)
SANITIZE=""
compute-sanitizer --version > /dev/null 2>&1 && SANITIZE="compute-sanitizer --tool memcheck --print-limit 8"
# tests_alone TB FILE...: each pytest -k expression read from stdin, alone in its own process with
# synchronous launches (the traceback then names the faulting launch), under memcheck where the
# machine has it, into $OUT/gpu_faults.log; then the first errors memcheck names (kernel, source
# line, address) and each test's verdict.
tests_alone() {
    local tb=$1 k
    shift
    while read -r k; do
        echo "== alone: $k"
        CUDA_LAUNCH_BLOCKING=1 timeout 150 $SANITIZE python3 -m pytest -x -q -p no:cacheprovider --rootdir /tmp \
            --tb="$tb" -k "$k" "$@" 2>&1
    done > "$OUT/gpu_faults.log"
    grep -E "^== alone|^=+ (Invalid|Out of|Address|at |by thread|Saved host)|passed|failed" "$OUT/gpu_faults.log" | head -60
}
if [[ " $PARTS " == *" tests "* ]]; then
    select="gpu or GPU or cuda_graph"
    [[ ${FLA_BWD:-0} == 1 ]] || select="($select) and not test_gpu_vs_fla_gdn2_backward"
    timeout "${TEST_SECONDS:-360}" python3 -m pytest -v -p no:cacheprovider --rootdir /tmp -k "$select" \
        "${TEST_FILES[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASS|FAIL|ERROR|passed|failed" | tail -40
    # A kernel fault poisons the process's CUDA context, so every later test fails with it: rerun
    # each failed test alone.
    if grep -q "illegal memory access" "$OUT/gpu_tests.log"; then
        grep -E "^FAILED " "$OUT/gpu_tests.log" | sed -E 's/^FAILED [^:]*::([A-Za-z0-9_]+).*/\1/' | sort -u | head -8 |
            tests_alone short "${TEST_FILES[@]}"
    fi
fi
if [[ " $PARTS " == *" fault "* ]]; then
    # Named tests of the backward (FAULT_K: ";"-separated pytest -k expressions), each alone.
    tr ';' '\n' <<< "${FAULT_K:-test_gpu_long_vs_naive and full and dtype0;test_gpu_long_vs_naive and full and dtype1}" |
        tests_alone line "$REPO"/tests/test_chunk_bwd.py
fi
if [[ " $PARTS " == *" bench "* ]]; then
    timeout "${BENCH_SECONDS:-330}" python3 "$REPO"/bench/kernel_times.py --json "$OUT/kernels.json" --commit "$COMMIT" \
        --budget $(( ${BENCH_SECONDS:-330} - 30 )) 2>&1 | tee "$OUT/kernels.log" | tail -60
fi
if [[ " $PARTS " == *" traffic "* ]]; then
    timeout 300 python3 "$REPO"/bench/kernel_times.py --quick --parts --json "$OUT/kernels_parts.json" --commit "$COMMIT" \
        2>&1 | tail -40
    python3 "$REPO"/bench/forward_traffic.py --measured "$OUT/kernels_parts.json" | tee "$OUT/forward_traffic.md" | tail -40
    timeout 200 python3 "$REPO"/scripts/scan_configs.py --json "$OUT/scan_configs.json" 2>&1 | tail -20
fi
if [[ " $PARTS " == *" versions "* ]]; then
    bash "$REPO"/scripts/h200_kernel_versions.sh
fi
if [[ " $PARTS " == *" scans "* ]]; then
    for T in 4096 8192 16384 32768; do
        only=""
        [[ $T == 4096 ]] || only="--state-only"   # the output kernel's work does not depend on T at fixed tokens
        timeout 150 python3 "$REPO"/scripts/scan_configs.py --B $(( 32768 / T )) --T $T $only \
            --json "$OUT/scan_configs-T$T.json" > "$OUT/scan_configs-T$T.log" 2>&1
        echo "== T=$T (exit $?)"
        grep -E "'rule': True|qed_state|'probes': True" "$OUT/scan_configs-T$T.log" | cut -c1-170
    done
fi
if [[ " $PARTS " == *" ncu "* ]]; then
    timeout 300 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section WarpStateStats --section LaunchStats \
        python3 "$REPO"/scripts/ncu_forward.py > "$OUT/ncu_forward.txt" 2>&1
    echo "ncu exit $?"
    grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per" "$OUT/ncu_forward.txt" | head -120
fi
