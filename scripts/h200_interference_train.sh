#!/usr/bin/env bash
# Train the interference checkpoints of issue 13 on one H200 (or more, GPU_IDS): 3 seeds x
# {gdn2, full, noproj} at lambda_max 0.25, plus full at lambda_max 1.0 (3 seeds): 12 runs at
# once sharing the GPU, the step count fitted to BUDGET by a measured 40-step probe
# (scripts/h200_recall_train.sh, which this only parametrises), so each run takes about BUDGET
# seconds of the H200 (default 1200, 20 min) or less.
#
# Recipe (docs/TRAINING.md, "The interference recipe"): the `small` shape, the `interference`
# mixture (MK-NIAH with 2-16 needles in noise and prose, as many queries as needles drawn with
# replacement, plus S-NIAH-1/2/3)
# in rows of L_train = 2048 BPE tokens (the tokenizer of `qedprobe train-tokenizer` with the
# arguments below, deterministic; trained here first if TOK has none, and shipped in every model
# folder), the answer loss with the key-dependent answer tokens weighted KEY_WEIGHT, the
# long-memory decay initialisation of the recall recipe.
#
#   setsid nohup bash scripts/h200_interference_train.sh > /tmp/interference-train.out 2>&1 < /dev/null &
#
# Environment: BUDGET, GPU_IDS, PER_GPU, CKPT, RUNS (see scripts/h200_recall_train.sh), TOK
# (tokenizer folder, default /tmp/tok-interference), KEY_WEIGHT (default 8), BATCH (rows per
# step, default 16), MIXTURE (default interference), MORE (further `qedprobe train` flags, e.g.
# "--conv-size 8"), ARMS / SEEDS / PREFIX (default "gdn2 full noproj full@1.0" / "0 1 2" /
# "int-": checkpoints int-gdn2-s0 ... int-full-lm1.0-s2). Expects qedprobe installed where
# `python3 -P` finds it (`source scripts/device_env.sh`). Evaluate with scripts/h200_interference_eval.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
TOK=${TOK:-/tmp/tok-interference}
[[ -f "$TOK/tokenizer.json" ]] || python3 -P -m qedprobe.cli train-tokenizer --mixture interference \
    --vocab-size 2048 --seq-len 8192 --rows 1000 --seed 0 --out "$TOK"
export BUDGET=${BUDGET:-1200} ARMS=${ARMS:-gdn2 full noproj full@1.0} SEEDS=${SEEDS:-0 1 2} PREFIX=${PREFIX:-int-}
export RECIPE="--mixture ${MIXTURE:-interference} --tokenizer $TOK --seq-len 2048 --batch-size ${BATCH:-16} --loss answer \
--key-weight ${KEY_WEIGHT:-8} --decay-a 0.5,2 --decay-dt 0.0001,0.1 ${MORE:-}"
exec bash scripts/h200_recall_train.sh
