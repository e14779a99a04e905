#!/usr/bin/env bash
# Train the 12 GPU checkpoints: six arms x seeds 0 and 1, preset "small" (hidden 256, 4 layers,
# 2 heads of dim 128, MLP ratio 2: 3.75M parameters, 7.5 MB as bf16; 32 rows x 1024 tokens per
# step; AdamW, WSD schedule, theta at 10x; see qedprobe/train/config.py).
#
#   scripts/train_checkpoints.sh [BUDGET_SECONDS]
#
# Run folders go to $RUNS/<name>/ (fp32 checkpoints, loss.jsonl, train.log), the frozen bf16
# models + MODEL_CARD.md to $CKPT/<name>/, <name> = $PREFIX<arm>-s<seed>, or
# $PREFIX<arm>-lm<L>-s<seed> for an ARMS entry <arm>@<L> (trained with --lambda-max L, e.g.
# full@1.0). The runs are dealt round-robin over the visible GPUs; each GPU runs PER_GPU of them at once (a model this small leaves most of an H200
# idle, so several processes share one), the rest of its share one after the other.
# Everything resumes: with BUDGET_SECONDS every run stops (checkpointed) before the budget of
# this call is spent; call the script again to continue. Finished runs (a model card exists)
# are skipped.
#
# Environment: PY (python, default: python3 -P, so that the installed qedprobe is imported and
# not the source folder of the current directory), GPU_IDS (GPUs to use, default: all visible),
# PER_GPU (runs at once per GPU, default: all of its share), SEEDS (default "0 1"), ARMS
# (default: all six; an entry <arm>@<L> sets lambda_max), PREFIX (run-name prefix, default none),
# EXTRA (more `qedprobe train` flags for every run, e.g. "--steps 800 --decay 160").
# A timing probe before the real thing:
#   EXTRA="--steps 40 --warmup 5 --decay 5 --save-every 40" RUNS=/tmp/probe CKPT=/tmp/probe-ckpt \
#     SEEDS=0 GPU_IDS=0 scripts/train_checkpoints.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3 -P}
PREFIX=${PREFIX:-}
RUNS=${RUNS:-runs/train}
CKPT=${CKPT:-checkpoints}
EXTRA=${EXTRA:-}
read -r -a GPU_LIST <<< "${GPU_IDS:-$(seq -s ' ' 0 $(($(nvidia-smi -L | wc -l) - 1)))}"
NGPU=${#GPU_LIST[@]}
read -r -a ARM_LIST <<< "${ARMS:-gdn2 nogate_noproj nogate full rand noproj}"
read -r -a SEED_LIST <<< "${SEEDS:-0 1}"
BUDGET=${1:-}
START=$(date +%s)
JOBS=()
for seed in "${SEED_LIST[@]}"; do for arm in "${ARM_LIST[@]}"; do JOBS+=("$arm $seed"); done; done
PER_GPU=${PER_GPU:-$(((${#JOBS[@]} + NGPU - 1) / NGPU))}
mkdir -p "$RUNS" "$CKPT"

run_slot() {  # run_slot GPU SLOT: the jobs i with i % NGPU == GPU and (i / NGPU) % PER_GPU == SLOT, in turn
    local gpu=$1 slot=$2 i entry arm seed name left limit lam
    for ((i = gpu + slot * NGPU; i < ${#JOBS[@]}; i += NGPU * PER_GPU)); do
        read -r entry seed <<< "${JOBS[$i]}"
        arm=${entry%@*} lam=()
        name=$PREFIX$arm-s$seed
        [[ $entry == *@* ]] && { lam=(--lambda-max "${entry#*@}"); name=$PREFIX$arm-lm${entry#*@}-s$seed; }
        [[ -f "$CKPT/$name/MODEL_CARD.md" ]] && { echo "skip $name (done)"; continue; }
        limit=()
        if [[ -n "$BUDGET" ]]; then
            left=$((BUDGET - ($(date +%s) - START) - 60))  # 60 s for start-up, checkpoint, export
            ((left > 60)) || { echo "skip $name (budget spent)"; continue; }
            limit=(--max-seconds "$left")
        fi
        echo "GPU ${GPU_LIST[$gpu]} slot $slot: $name"
        # shellcheck disable=SC2086
        CUDA_VISIBLE_DEVICES=${GPU_LIST[$gpu]} $PY -m qedprobe.cli train --preset small --arm "$arm" --seed "$seed" \
            --out "$RUNS/$name" --export "$CKPT/$name" --print-every 100 "${lam[@]}" "${limit[@]}" $EXTRA \
            >> "$RUNS/$name.stdout" 2>&1 || echo "FAILED $name (see $RUNS/$name.stdout)"
    done
}

for ((g = 0; g < NGPU; g++)); do for ((s = 0; s < PER_GPU; s++)); do run_slot "$g" "$s" & done; done
wait
$PY - "$CKPT" "$RUNS" <<'PY'
import json, pathlib, statistics, sys
ckpt, runs = map(pathlib.Path, sys.argv[1:])
for d in sorted(runs.glob("*-s[0-9]")):
    if not d.is_dir():
        continue
    log = [json.loads(line) for line in (d / "loss.jsonl").open()] if (d / "loss.jsonl").is_file() else []
    w = ckpt / d.name / "model.safetensors"
    size = w.stat().st_size if w.is_file() else 0
    done = (ckpt / d.name / "MODEL_CARD.md").is_file()
    step_s = statistics.median(r["step_s"] for r in log[len(log) // 4:]) if log else float("nan")
    loss = log[-1]["loss"] if log else float("nan")
    print(f"{d.name:20s} {'done' if done else 'unfinished':10s} steps {len(log):5d}  {step_s:6.3f} s/step  "
          f"loss {loss:.4f}  {size / 1e6:5.2f} MB" + ("  OVER 16 MB" if size > 16e6 else ""))
PY
