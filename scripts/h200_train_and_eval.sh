#!/usr/bin/env bash
# One device call on a 2-GPU machine: train the twelve checkpoints, send back as many as fit,
# measure them for docs/RESULTS.md.
#   run(command="STEPS=850 bash scripts/h200_train_and_eval.sh", carry=[".whl"], kind="nvidia-h200-x2")
# 1. scripts/train_checkpoints.sh: 6 arms x seeds 0,1, six runs at once per GPU, STEPS steps
#    (warmup 7 %, decay 20 %) plus TRAIN_FLAGS (e.g. "--decay-a 0.5,2 --decay-dt 1e-4,0.1"), into
#    /tmp/ckpt; ARMS, SEEDS and PER_GPU pass on to it;
# 2. $OUT/ckpt-N.tar: the checkpoints in pairs, the first 8 by name, or PACK (';'-separated
#    pairs). A call sends back at most 64 MiB in 8 files of 16 MiB, so 8 of the 12 7.5-MB
#    checkpoints; the rest waits on the machine for the next call, made within its 30 s of
#    warmth: `tar -C /tmp/ckpt -cf $OUT/ckpt-5.tar A B`;
# 3. scripts/eval_checkpoints.sh on all twelve (EVAL_SECONDS at most), then $OUT/eval.tgz with the
#    sweep rows, summaries, eig statistics and the training logs.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh || exit 1
STEPS=${STEPS:-850}
T0=$(date +%s)
CKPT=/tmp/ckpt RUNS=/tmp/runs EXTRA="--steps $STEPS --warmup $((STEPS * 7 / 100)) --decay $((STEPS / 5)) --save-every $STEPS ${TRAIN_FLAGS:-}" \
    bash scripts/train_checkpoints.sh | tee "$OUT/train.log"
echo "training wall $(($(date +%s) - T0)) s" | tee -a "$OUT/train.log"
if [[ -n "${PACK:-}" ]]; then IFS=';' read -r -a PAIRS <<< "$PACK"; else
    mapfile -t DONE < <(cd /tmp/ckpt && ls -d -- *-s[0-9] 2>/dev/null)
    PAIRS=()
    for ((i = 0; i < ${#DONE[@]} && i < 8; i += 2)); do PAIRS+=("${DONE[*]:i:2}"); done
    ((${#DONE[@]} > 8)) && echo "left on the machine (next call): ${DONE[*]:8}"
fi
for i in "${!PAIRS[@]}"; do
    # shellcheck disable=SC2086
    tar -C /tmp/ckpt -cf "$OUT/ckpt-$((i + 1)).tar" ${PAIRS[$i]}
done
ls -l "$OUT"
T1=$(date +%s)
CKPT=/tmp/ckpt EVAL=/tmp/eval PER_GPU=${PER_GPU:-3} SAMPLES=${SAMPLES:-100} \
    timeout "${EVAL_SECONDS:-150}" bash scripts/eval_checkpoints.sh | tee "$OUT/eval.log"
echo "eval wall $(($(date +%s) - T1)) s" | tee -a "$OUT/eval.log"
tail -n 3 /tmp/eval/*.log
tar -czf "$OUT/eval.tgz" --exclude='*.png' --exclude='*.pt' --exclude='*.safetensors' --exclude='step-*' \
    -C /tmp eval runs
ls -l "$OUT"
