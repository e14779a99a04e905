#!/usr/bin/env bash
# A recipe screen for issue 13 in one 30-minute lease of one H200: which change to the
# interference recipe makes the models match keys (real MK-NIAH above chance, the foreign-key
# control at or below it) within the budget? Four variants x the arms gdn2, full, noproj, seed 0,
# twelve runs sharing the GPU for BUDGET seconds, then scripts/key_retrieval.py on each. Four calls
# made back to back (each within the machine's 30 s of warmth, so the detached training survives):
#   run(command="PHASE=start bash scripts/h200_interference_screen.sh", carry=[".whl", "runs/tok-interference"])
#   run(command="PHASE=wait bash scripts/h200_interference_screen.sh", carry=[".whl"])
#   run(command="PHASE=eval bash scripts/h200_interference_screen.sh", carry=[".whl"])
#   run(command="PHASE=pack FIRST=7 bash scripts/h200_interference_screen.sh", carry=[".whl"])
# start: the kernels' GPU tests first (TESTS: parts of scripts/h200_kernels.sh, default "tests",
#   TEST_SECONDS default 180; "" for none; parts other than "tests" run beside the training), so
#   that a kernel fault cannot touch the training; then, when MPS=1 (default) and the tests (if
#   run) hit no fault, the CUDA MPS daemon so
#   that the twelve small processes run their kernels side by side instead of in turns; then the
#   four variants (VARIANTS) detached, each through scripts/h200_interference_train.sh;
# wait: until every variant says "training done" (at most WAIT_SECONDS, default 560);
# eval: key_retrieval.py at the training length, 4 needles, noise and prose, SAMPLES prompts
#   (default 40), one process per variant, then $OUT/screen.tgz and the first checkpoints;
# pack: the checkpoints from the FIRST-th on.
# VARIANTS: ";"-separated "prefix|mixture|rows per step|more train flags"; SCREEN_ARMS the arms
# of each (default "gdn2 full noproj"; <arm>@<L> for lambda_max L), SEEDS (default 0). The twelve
# checkpoints of issue 13 with one recipe: VARIANTS="int-|interference|16|--conv-size 8"
# SCREEN_ARMS="gdn2 full noproj full@1.0" SEEDS="0 1 2", then PHASE=eval and pack of
# scripts/h200_interference_lease.sh (the full evaluation; same /tmp/ckpt).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
export OUT=${OUT:-/tmp/out} CKPT=/tmp/ckpt RUNS=/tmp/runs EVAL=/tmp/eval
mkdir -p "$OUT"
source scripts/device_env.sh || exit 1
source scripts/interference_runs.sh
VARIANTS=${VARIANTS:-"int-|interference|16|;c8-|interference|16|--conv-size 8;\
c8b8-|interference|8|--conv-size 8;c8s-|interference-short|16|--conv-size 8"}
IFS=';' read -r -a VARIANT_LIST <<< "$VARIANTS"
MPS_PIPE=/tmp/mps-pipe
stop_mps() { [[ -d $MPS_PIPE ]] && echo quit | CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE nvidia-cuda-mps-control 2> /dev/null; true; }
start_mps() {  # the MPS daemon, kept only if a CUDA op then works through it
    command -v nvidia-cuda-mps-control > /dev/null || { echo "mps: no nvidia-cuda-mps-control"; return 1; }
    mkdir -p "$MPS_PIPE" /tmp/mps-log
    export CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    if nvidia-cuda-mps-control -d && timeout 60 python3 -c "import torch; print(torch.ones(8, device='cuda').sum().item())"; then
        echo "mps: on"; return 0
    fi
    echo quit | nvidia-cuda-mps-control 2> /dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "mps: could not be used"; return 1
}
case ${PHASE:?PHASE must be start, wait, eval or pack} in
start)
    TOK=$(cd "${TOK:-runs/tok-interference}" && pwd) || { echo "no tokenizer folder ${TOK:-runs/tok-interference}"; exit 1; }
    TESTS=${TESTS-tests}
    faulted=0
    if [[ " $TESTS " == *" tests "* ]]; then
        PARTS=tests TEST_SECONDS=${TEST_SECONDS:-180} bash scripts/h200_kernels.sh
        grep -q "illegal memory access\|FAILED" "$OUT/gpu_tests.log" && faulted=1
    fi
    [[ ${MPS:-1} == 1 && $faulted == 0 ]] && start_mps
    T0=$(date +%s)
    for v in "${VARIANT_LIST[@]}"; do
        IFS='|' read -r prefix mixture batch more <<< "$v"
        echo "variant $prefix: --mixture $mixture --batch-size $batch $more"
        PREFIX=$prefix MIXTURE=$mixture BATCH=$batch MORE=$more ARMS=${SCREEN_ARMS:-gdn2 full noproj} SEEDS=${SEEDS:-0} \
            TOK=$TOK BUDGET=$((${BUDGET:-800} - ($(date +%s) - T0))) \
            setsid nohup bash scripts/h200_interference_train.sh > "/tmp/train-$prefix.out" 2>&1 < /dev/null &
    done
    beside=""
    for part in $TESTS; do [[ $part == tests ]] || beside+=" $part"; done
    [[ -n $beside ]] && PARTS=$beside bash scripts/h200_kernels.sh  # the other parts, beside the training
    sleep "${SHOW_SECONDS:-100}"
    tail -n 4 /tmp/train-*.out; runs_status ;;
wait)
    T0=$(date +%s)
    done_all() { for v in "${VARIANT_LIST[@]}"; do grep -q "training done\|no training" "/tmp/train-${v%%|*}.out" || return 1; done; }
    while ! done_all && (( $(date +%s) - T0 < ${WAIT_SECONDS:-560} )); do sleep 10; done
    done_all && stop_mps
    cp /tmp/train-*.out "$OUT/"; tail -n 3 /tmp/train-*.out; runs_status ;;
eval)
    stop_mps
    mkdir -p "$EVAL"
    for v in "${VARIANT_LIST[@]}"; do
        prefix=${v%%|*}
        mapfile -t models < <(ls -d "$CKPT/$prefix"*/ 2> /dev/null)
        (( ${#models[@]} )) || { echo "no checkpoints of $prefix"; continue; }
        timeout "${EVAL_SECONDS:-300}" python3 -P scripts/key_retrieval.py "${models[@]}" --lengths 2048 --needles 4 \
            --haystacks noise,prose --samples "${SAMPLES:-40}" --device cuda --out "$EVAL/$prefix" \
            > "$EVAL/$prefix.log" 2>&1 &
    done
    wait
    cat "$EVAL"/*/key_retrieval.md 2> /dev/null | grep -v "^|---\|^| model"
    pack_runs_and_eval "$OUT/screen.tgz" /tmp/train-*.out
    bash scripts/pack_for_return.sh "$CKPT" 0 ;;
pack)
    bash scripts/pack_for_return.sh "$CKPT" "${FIRST:?FIRST: the first checkpoint not yet sent back}" ;;
*)
    echo "PHASE must be start, wait, eval or pack, got '$PHASE'"; exit 2 ;;
esac
