#!/usr/bin/env bash
# Train the 12 GPU checkpoints: six arms x seeds 0 and 1, preset "small" (hidden 256, 6 layers,
# 2 heads of dim 128, 6.78M parameters, 13.6 MB as bf16; seq_len 2048, 32 rows/step,
# 1500 steps = 98M tokens; AdamW 1e-3, WSD 100 warmup / 300 decay; theta at 10x).
#
#   bench/train_checkpoints.sh [BUDGET_SECONDS]
#
# Run folders go to runs/train/<arm>-s<seed>/ (fp32 checkpoints, loss.jsonl, train.log), the
# frozen bf16 models + MODEL_CARD.md to checkpoints/<arm>-s<seed>/. Runs are spread over the
# visible GPUs (one process per GPU, each working through its share of the 12 runs in turn).
# Everything resumes: with BUDGET_SECONDS every run stops (checkpointed) before the budget of
# this call is spent; call the script again to continue. Finished runs (a model card exists)
# are skipped.
#
# Environment: PY (python, default: python), GPUS (how many GPUs to use, default: all visible),
# EXTRA (more `qedprobe train` flags for every run, e.g. "--steps 800 --decay 160").
# A quick timing probe before the real thing:
#   EXTRA="--steps 30 --warmup 5 --decay 5 --save-every 30" RUNS=runs/probe CKPT=runs/probe-ckpt \
#     GPUS=1 bench/train_checkpoints.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
RUNS=${RUNS:-runs/train}
CKPT=${CKPT:-checkpoints}
EXTRA=${EXTRA:-}
NGPU=${GPUS:-$(nvidia-smi -L | wc -l)}
BUDGET=${1:-}
START=$(date +%s)
ARMS=(gdn2 nogate_noproj nogate full rand noproj)
JOBS=()
for seed in 0 1; do for arm in "${ARMS[@]}"; do JOBS+=("$arm $seed"); done; done
mkdir -p "$RUNS" "$CKPT"

run_gpu() {  # run_gpu GPU: the jobs i with i % NGPU == GPU, one after the other
    local gpu=$1 i arm seed left limit
    for ((i = gpu; i < ${#JOBS[@]}; i += NGPU)); do
        read -r arm seed <<< "${JOBS[$i]}"
        [[ -f "$CKPT/$arm-s$seed/MODEL_CARD.md" ]] && { echo "skip $arm-s$seed (done)"; continue; }
        limit=()
        if [[ -n "$BUDGET" ]]; then
            left=$((BUDGET - ($(date +%s) - START) - 60))  # 60 s for start-up, checkpoint, export
            ((left > 60)) || { echo "skip $arm-s$seed (budget spent)"; continue; }
            limit=(--max-seconds "$left")
        fi
        echo "GPU $gpu: $arm seed $seed"
        # shellcheck disable=SC2086
        CUDA_VISIBLE_DEVICES=$gpu "$PY" -m qedprobe.train --preset small --arm "$arm" --seed "$seed" \
            --out "$RUNS/$arm-s$seed" --export "$CKPT/$arm-s$seed" --print-every 100 "${limit[@]}" $EXTRA \
            >> "$RUNS/$arm-s$seed.stdout" 2>&1 || echo "FAILED $arm-s$seed (see $RUNS/$arm-s$seed.stdout)"
    done
}

for ((g = 0; g < NGPU; g++)); do run_gpu "$g" & done
wait
"$PY" - "$CKPT" <<'PY'
import pathlib, sys
for d in sorted(pathlib.Path(sys.argv[1]).glob("*-s[01]")):
    w = d / "model.safetensors"
    size = w.stat().st_size if w.is_file() else 0
    done = (d / "MODEL_CARD.md").is_file()
    print(f"{d.name:22s} {'done' if done else 'unfinished':10s} {size / 1e6:6.2f} MB"
          + ("  OVER 16 MB" if size > 16e6 else ""))
PY
