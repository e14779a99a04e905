#!/usr/bin/env bash
# Every GPU test of the suite on this machine's GPU, with a kernel fault pinned to its test:
#
#   scripts/gpu_tests.sh --out DIR [--files test_a,test_b] [--fla-backward] [--timeout 600] [--python "python3 -P"]
#       [-- PYTEST ARGS]
#
# Runs `pytest -k "gpu or GPU or cuda_graph"` on the kernel, decode, fast-path and real-model tests
# (the chunked forward and backward against float64 `qed_naive` and fla, `qed_recurrent`, the
# CUDA-graph decode, the compiled fast path, the per-head and KDA gates, the transformers families
# through the Triton path) into OUT/gpu_tests.log. A kernel fault poisons the
# process's CUDA context, so every later test of that process fails with it: each test that failed
# with an illegal memory access is then rerun alone with synchronous launches (the traceback
# names the faulting launch), under compute-sanitizer's memcheck where the machine has it, into
# OUT/gpu_faults.log. `test_gpu_vs_fla_gdn2_backward` runs only with --fla-backward (fla autotunes
# its backward for minutes). `--files` runs only the named test files of that list (e.g.
# `--files test_hf_adapter`: on a fresh machine the whole list needs more than one 600 s call, the
# real-model tests compiling for minutes). Exit status: pytest's.
# Run it from any folder: the tests import the installed qedprobe (with `source
# scripts/device_env.sh` on a machine without a package index, docs/BENCHMARKS.md).
set -uo pipefail
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "gpu_tests.sh: $*" >&2; exit 2; }

OUT="" FLA_BWD=0 TIMEOUT=600 PY="python3 -P" ONLY="" MORE=()
while (($#)); do
    case $1 in
        -h | --help) usage ;;
        --fla-backward) FLA_BWD=1; shift; continue ;;
        --) shift; MORE=("$@"); break ;;
    esac
    [[ $# -ge 2 ]] || die "$1 needs a value"
    case $1 in
        --out) OUT=$2 ;; --timeout) TIMEOUT=$2 ;; --python) PY=$2 ;; --files) ONLY=$2 ;;
        *) die "unknown argument '$1' (--help lists them)" ;;
    esac
    shift 2
done
[[ -n $OUT ]] || die "--out DIR is required"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TESTS=$(cd "$(dirname "$0")/../tests" && pwd)
FILES=("$TESTS"/test_chunk.py "$TESTS"/test_chunk_bwd.py "$TESTS"/test_fused_recurrent.py
       "$TESTS"/test_decode_fast.py "$TESTS"/test_fast_path.py "$TESTS"/test_head_gates.py
       "$TESTS"/test_hf_adapter.py)
if [[ -n $ONLY ]]; then
    KNOWN=("${FILES[@]}") FILES=()
    IFS=, read -ra NAMES <<< "$ONLY"
    for name in "${NAMES[@]}"; do
        file=$TESTS/${name%.py}.py
        [[ " ${KNOWN[*]} " == *" $file "* ]] \
            || die "--files: '$name' is not one of: $(basename -a "${KNOWN[@]}" | tr '\n' ' ')"
        FILES+=("$file")
    done
fi
# test_fast_path's trained-model test reads this checkpoint; a tree copied without checkpoints/ would fail it.
TRAINED=$(dirname "$TESTS")/checkpoints/recall-full-s1/model.safetensors
[[ " ${FILES[*]} " != *" $TESTS/test_fast_path.py "* || -f $TRAINED ]] \
    || die "needs $TRAINED (a sparse tree must keep it: git sparse-checkout set --no-cone" \
        "'/*' '!/checkpoints/' '/checkpoints/recall-full-s1/')"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu_tests.log"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu_tests.log"
# From a scratch folder, so that a source checkout in the working directory is not imported.
cd "$(mktemp -d)"
select="gpu or GPU or cuda_graph"
((FLA_BWD)) || select="($select) and not test_gpu_vs_fla_gdn2_backward"
timeout "$TIMEOUT" $PY -m pytest -v -p no:cacheprovider --rootdir . -k "$select" "${FILES[@]}" "${MORE[@]}" \
    >> "$OUT/gpu_tests.log" 2>&1
status=$?
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_tests.log" | tail -60
grep -q "illegal memory access" "$OUT/gpu_tests.log" || exit $status

SANITIZE=()
compute-sanitizer --version > /dev/null 2>&1 && SANITIZE=(compute-sanitizer --tool memcheck --print-limit 8)
grep -E "^FAILED " "$OUT/gpu_tests.log" | sed -E 's/^FAILED ([^ ]+).*/\1/' | sort -u | head -8 | while read -r test; do
    echo "== alone: $test"
    # shellcheck disable=SC2086
    CUDA_LAUNCH_BLOCKING=1 timeout 150 "${SANITIZE[@]}" $PY -m pytest -x -q -p no:cacheprovider --rootdir . \
        --tb=short "$test" 2>&1
done > "$OUT/gpu_faults.log"
grep -E "^== alone|^=+ (Invalid|Out of|Address|at |by thread|Saved host)|passed|failed" "$OUT/gpu_faults.log" | head -60
exit $status
