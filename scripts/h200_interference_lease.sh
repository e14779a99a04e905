#!/usr/bin/env bash
# Issue 13's GPU work in one 30-minute lease of one H200, as four calls made back to back (each
# within the machine's 30 s of warmth, so the detached training survives between them):
#   run(command="PHASE=start bash scripts/h200_interference_lease.sh", carry=[".whl", "runs/tok-interference"])
#   run(command="PHASE=wait bash scripts/h200_interference_lease.sh", carry=[".whl"])
#   run(command="PHASE=eval bash scripts/h200_interference_lease.sh", carry=[".whl"])
#   run(command="PHASE=pack FIRST=7 bash scripts/h200_interference_lease.sh", carry=[".whl"])
# start: trains the twelve checkpoints detached (scripts/h200_interference_train.sh, BUDGET
#   seconds from now, default 900; the tokenizer folder TOK, default runs/tok-interference, is made
#   here beforehand with the train-tokenizer command of that script, so no device time goes to
#   it), then runs the kernels' GPU tests beside it (TEST_SECONDS, default 240);
# wait: waits for the training's end (at most WAIT_SECONDS, default 560) and prints each run's
#   last line;
# eval: scripts/h200_interference_eval.sh, PER_GPU sweeps side by side (default 6: twelve ran
#   the H200 out of memory at 32K), for at most EVAL_SECONDS (default 420; every sweep
#   resumes, so a cut run loses nothing done), then $OUT/eval.tgz (sweep rows and summaries, eig
#   statistics, training logs) and as many checkpoints as fit in what a call brings back;
# pack: the checkpoints from the FIRST-th on (scripts/pack_for_return.sh).
# Wheels: `bash scripts/device_wheels.sh` here first. Raw outputs go under docs/results/<date>/.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
export OUT=${OUT:-/tmp/out} CKPT=/tmp/ckpt RUNS=/tmp/runs EVAL=/tmp/eval
mkdir -p "$OUT"
source scripts/device_env.sh || exit 1
source scripts/interference_runs.sh
case ${PHASE:?PHASE must be start, wait, eval or pack} in
start)
    TOK=$(cd "${TOK:-runs/tok-interference}" && pwd) || { echo "no tokenizer folder ${TOK:-runs/tok-interference}"; exit 1; }
    TOK=$TOK BUDGET=${BUDGET:-900} setsid nohup bash scripts/h200_interference_train.sh > /tmp/train.out 2>&1 < /dev/null &
    PARTS=tests TEST_SECONDS=${TEST_SECONDS:-240} bash scripts/h200_kernels.sh
    cp /tmp/train.out "$OUT/"; tail -16 /tmp/train.out; runs_status ;;
wait)
    T0=$(date +%s)
    while ! grep -q "training done\|no training" /tmp/train.out && (( $(date +%s) - T0 < ${WAIT_SECONDS:-560} )); do sleep 10; done
    cp /tmp/train.out "$OUT/"; tail -16 /tmp/train.out; runs_status ;;
eval)
    PER_GPU=${PER_GPU:-6} timeout "${EVAL_SECONDS:-420}" bash scripts/h200_interference_eval.sh
    pack_runs_and_eval "$OUT/eval.tgz" /tmp/train.out
    bash scripts/pack_for_return.sh "$CKPT" 0 ;;
pack)
    bash scripts/pack_for_return.sh "$CKPT" "${FIRST:?FIRST: the first checkpoint not yet sent back}" ;;
*)
    echo "PHASE must be start, wait, eval or pack, got '$PHASE'"; exit 2 ;;
esac
