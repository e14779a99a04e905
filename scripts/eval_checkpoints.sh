#!/usr/bin/env bash
# Measure the trained checkpoints for docs/RESULTS.md (one device call, after training):
# * every checkpoint: each cell of TASKS (default S-NIAH-1) at 1x..16x the training length
#   (LENGTHS, default 1K..16K tokens), s = 1;
# * the QED checkpoints (arms of STRENGTH_ARMS, default full): on the first cell, the Table-4
#   strength sweep, s in -1,0,0.5,1,1.5,2, same samples;
# * every arm but gdn2: `qedprobe eig` (e_t histograms and ranges; EIG, default S-NIAH-1 at 2K).
# All sweeps use --seed 0, so sample i at length L is the same prompt for every checkpoint and
# strength: `qedprobe report` then pairs arms on shared samples.
#
#   CKPT=checkpoints EVAL=runs/eval scripts/eval_checkpoints.sh
#
# Environment: PY (default python3 -P), CKPT (folder of <arm>-s<seed>/ checkpoints), EVAL (output
# folder: EVAL/<name>/<cell> and EVAL/<name>/eig), GPU_IDS (default: all visible), PER_GPU (processes
# at once per GPU, default 3), SAMPLES (default 100), LENGTHS (default 1K,2K,4K,8K,16K),
# TASKS (';'-separated cells "<cell>|<sweep flags>", later flags win over --lengths; default
# "sweep|--task s-niah-1"), STRENGTHS (default -1,0,0.5,1,1.5,2), STRENGTH_ARMS (default "full"),
# EIG (eig flags, default "--task s-niah-1 --length 2K"), ONLY (space list of checkpoint names),
# DEVICE (instead of cuda:<gpu>, e.g. cpu for a dry run), FORMAT (task format; default: the one each
# checkpoint's config.json records as task_format, else ruler).
# Each sweep resumes (rerun to finish); logs in EVAL/<name>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3 -P}
CKPT=${CKPT:-checkpoints}
EVAL=${EVAL:-runs/eval}
SAMPLES=${SAMPLES:-100}
LENGTHS=${LENGTHS:-1K,2K,4K,8K,16K}
STRENGTHS=${STRENGTHS:--1,0,0.5,1,1.5,2}
STRENGTH_ARMS=" ${STRENGTH_ARMS:-full} "
EIG=${EIG:---task s-niah-1 --length 2K}
IFS=';' read -r -a CELLS <<< "${TASKS:-sweep|--task s-niah-1}"
read -r -a GPU_LIST <<< "${GPU_IDS:-$(seq -s ' ' 0 $(($(nvidia-smi -L | wc -l) - 1)))}"
PER_GPU=${PER_GPU:-3}
if [[ -n "${ONLY:-}" ]]; then read -r -a NAMES <<< "$ONLY"; else
    mapfile -t NAMES < <(cd "$CKPT" && ls -d -- *-s[0-9] | grep -v '^micro-'); fi
mkdir -p "$EVAL"

evaluate() {  # evaluate NAME GPU
    local name=$1 s arm fmt cell flags i
    arm=$($PY -c 'import json, sys; print(json.load(open(sys.argv[1]))["arm"])' "$CKPT/$name/config.json")
    fmt=${FORMAT:-$($PY -c 'import json, sys; print(json.load(open(sys.argv[1])).get("task_format") or "ruler")' \
        "$CKPT/$name/config.json")}
    for i in "${!CELLS[@]}"; do
        IFS='|' read -r cell flags <<< "${CELLS[$i]}"
        s=1
        [[ $i == 0 && $STRENGTH_ARMS == *" $arm "* ]] && s=$STRENGTHS
        # shellcheck disable=SC2086
        $PY -m qedprobe.cli sweep --model "$CKPT/$name" --device "${DEVICE:-cuda:$2}" --format "$fmt" --lengths "$LENGTHS" \
            $flags --strengths="$s" --samples "$SAMPLES" --seed 0 --out "$EVAL/$name/$cell" --no-progress || return 1
    done
    # shellcheck disable=SC2086
    [[ $arm == gdn2 ]] || $PY -m qedprobe.cli eig --model "$CKPT/$name" --device "${DEVICE:-cuda:$2}" --format "$fmt" $EIG \
        --samples 16 --seed 0 --out "$EVAL/$name/eig" --no-progress
}

slots=$((${#GPU_LIST[@]} * PER_GPU))
for ((slot = 0; slot < slots; slot++)); do
    (for ((i = slot; i < ${#NAMES[@]}; i += slots)); do
        gpu=${GPU_LIST[$((slot % ${#GPU_LIST[@]}))]}
        echo "cuda:$gpu ${NAMES[$i]}"
        evaluate "${NAMES[$i]}" "$gpu" > "$EVAL/${NAMES[$i]}.log" 2>&1 || echo "FAILED ${NAMES[$i]} (see $EVAL/${NAMES[$i]}.log)"
    done) &
done
wait
