#!/usr/bin/env bash
# Train GPU checkpoints with a recipe (RECIPE, default the recall recipe of docs/TRAINING.md) for
# as many steps as a time budget affords, the step count measured rather than guessed:
# 1. a 40-step probe of all the runs at once (scripts/train_checkpoints.sh into /tmp/probe-PREFIX) gives
#    the median seconds per step under that load;
# 2. the real runs get STEPS = (what is left of BUDGET - 120 s for start-up and export) / that,
#    with 15 % slack on the step time, warmup 100 steps, the last 20 % decaying, and --max-seconds as a safety net.
# Meant to run in the background of other device work, detached so that it outlives the call
# that started it (the machine stays up while calls follow within its 30 s of warmth):
#   setsid nohup bash scripts/h200_recall_train.sh > /tmp/recall-train.out 2>&1 < /dev/null &
# Environment: BUDGET (seconds from now until the checkpoints must exist, default 1000), ARMS
# (default "gdn2 full"; <arm>@<L> trains with lambda_max L), SEEDS (default "0 1"), PREFIX
# (run-name prefix, default none), GPU_IDS (default 0), PER_GPU (default: all runs at once),
# RECIPE (training flags, default below), CKPT / RUNS (default /tmp/ckpt, /tmp/runs), STEPS (a
# fixed step count instead of the probe's, e.g. to train more seeds of a recipe already trained).
# scripts/h200_interference_train.sh calls it with the interference recipe.
# Expects qedprobe installed where `python3 -P` finds it (`source scripts/device_env.sh`).
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET=${BUDGET:-1000}
RECIPE=${RECIPE:---mixture short --loss answer --decay-a 0.5,2 --decay-dt 0.0001,0.1}
export ARMS=${ARMS:-gdn2 full} SEEDS=${SEEDS:-0 1} GPU_IDS=${GPU_IDS:-0} PREFIX=${PREFIX:-}
[[ -n "${PER_GPU:-}" ]] && export PER_GPU

if [[ -z "${STEPS:-}" ]]; then
    PROBE=/tmp/probe-${PREFIX:-runs}  # one per PREFIX, so that several of these can run at once
    RUNS=$PROBE CKPT=$PROBE-ckpt EXTRA="--steps 40 --warmup 5 --decay 5 --save-every 40 $RECIPE" \
        bash scripts/train_checkpoints.sh | tee "$PROBE.txt"
    STEP_S=$(awk '/s\/step/ {for (i = 1; i < NF; i++) if ($(i + 1) == "s/step") print $i}' "$PROBE.txt" | sort -g | tail -1)
    [[ -n "$STEP_S" ]] || { echo "every probe run failed (see $PROBE/*.stdout): no training"; exit 1; }
    LEFT=$((BUDGET - ($(date +%s) - START) - 120))  # then 15 % slack on the step time:
    STEPS=$(python3 -c "print(max(200, int($LEFT / ($STEP_S * 1.15)) // 100 * 100))")
    echo "probe: $STEP_S s/step (slowest run); $LEFT s left -> $STEPS steps"
else
    echo "STEPS=$STEPS given: no probe"
fi
RUNS=${RUNS:-/tmp/runs} CKPT=${CKPT:-/tmp/ckpt} \
    EXTRA="--steps $STEPS --warmup 100 --decay $((STEPS / 5)) --save-every 500 $RECIPE" \
    bash scripts/train_checkpoints.sh "$((BUDGET - ($(date +%s) - START) - 30))"
echo "training done after $(($(date +%s) - START)) s"
