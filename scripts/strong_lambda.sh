#!/usr/bin/env bash
# QED models whose correction carries weight, and the Table-4 measurement of them (any CUDA machine):
#
#   scripts/strong_lambda.sh train --out DIR [--seeds "0 1 2"] [--arms "full noproj"] [--lambda-max 1.0]
#       [--theta-init 0] [--theta-lr-mult 10] [--steps 1200] [--budget SECONDS] [--gpus "0"] [--prefix strong-]
#       [--baseline checkpoints]
#   scripts/strong_lambda.sh eval --out DIR [--baseline checkpoints] [--needles "4 8"]
#       [--lengths 2K,4K,8K,16K,32K] [--samples 100] [--phases "all prefill decode"] [--budget SECONDS]
#       [--gpus "0"] [--per-gpu 4] [--batch-tokens 262144] [--prefix strong-] [--device cpu]
#
# train: the interference recipe of the shipped `interference-*` (scripts/train_checkpoints.sh
# --recipe interference: the same data, seeds and initialisation, so runs pair with the shipped
# `interference-gdn2-s<seed>`; the BPE tokenizer is the one shipped in --baseline's
# interference-gdn2-s0, so the tokens are theirs too) with lambda = lambda_max * sigmoid(theta) started at
# lambda_max * sigmoid(--theta-init) (0: lambda_max / 2) and theta's rate --theta-lr-mult x the
# learning rate. Runs go to DIR/runs/<name>/, models to DIR/ckpt/<name>/, <name> =
# <prefix><arm>-lm<lambda_max>-s<seed>. --budget caps each run's seconds in this call (it stops at
# a checkpoint; the same command resumes it).
# eval: for every model of DIR/ckpt, MK-NIAH (legacy format, prose haystack) with each --needles count
# at every length, s in -1, 0, 0.5, 1, 1.5, 2, strength applied in each --phases (all: prefill and
# decode; prefill only; decode only), --samples prompts per cell, evaluation seed 0 (the prompts of
# the shipped models' measurements); the GDN-2 model of the same seed from --baseline on the same
# cells at s = 1; `qedprobe report` of QED against it per cell (DIR/reports/); then
# scripts/strength_targets.py prints every cell's largest change against s = 1 with its exact
# McNemar p and the targets (s = 1 >= 90 % at the training length, 2K, with 4 needles; some s
# >= 20 points from s = 1 with p < 1e-3) and draws DIR/strength-mk4.png (accuracy against s per model and
# length, 4 needles, strength in prefill and decode). --budget stops the sweeps after that many seconds
# (`timeout`; the rows stay and the same command resumes them). Sweeps: DIR/eval/<name>/<cell>/.
# --batch-tokens: prompt tokens per generate call of each sweep (fixed, so that --per-gpu sweeps
# sharing a GPU do not each size their batches to 60 % of its free memory and run it out).
# --device runs every sweep there instead of on cuda:<gpu> (e.g. cpu, for a dry run on few prompts).
# Run from the repository root (--baseline is a relative path by default).
set -euo pipefail
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "strong_lambda.sh: $*" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)

STAGE=${1:-}
case $STAGE in -h | --help) usage ;; train | eval) shift ;; *) die "first argument: train or eval (--help)" ;; esac
OUT="" SEEDS="0 1 2" ARMS="full noproj" LAMBDA_MAX=1.0 THETA_INIT=0 THETA_LR=10 STEPS=1200 BUDGET=""
GPUS="" PREFIX=strong- BASELINE=checkpoints NEEDLES="4 8" LENGTHS=2K,4K,8K,16K,32K SAMPLES=100
PHASES="all prefill decode" PER_GPU=4 PY="python3 -P" DEVICE="" BATCH_TOKENS=262144
while (($#)); do
    case $1 in -h | --help) usage ;; esac
    [[ $# -ge 2 ]] || die "$1 needs a value"
    case $1 in
        --out) OUT=$2 ;; --seeds) SEEDS=$2 ;; --arms) ARMS=$2 ;; --lambda-max) LAMBDA_MAX=$2 ;;
        --theta-init) THETA_INIT=$2 ;; --theta-lr-mult) THETA_LR=$2 ;; --steps) STEPS=$2 ;;
        --budget) BUDGET=$2 ;; --gpus) GPUS=$2 ;; --prefix) PREFIX=$2 ;; --baseline) BASELINE=$2 ;;
        --needles) NEEDLES=$2 ;; --lengths) LENGTHS=$2 ;; --samples) SAMPLES=$2 ;; --phases) PHASES=$2 ;;
        --per-gpu) PER_GPU=$2 ;; --python) PY=$2 ;; --device) DEVICE=$2 ;; --batch-tokens) BATCH_TOKENS=$2 ;;
        *) die "unknown argument '$1' (--help lists them)" ;;
    esac
    shift 2
done
[[ -n $OUT ]] || die "--out DIR is required"
[[ -z $BUDGET || $BUDGET =~ ^[1-9][0-9]*$ ]] || die "--budget must be a positive number of seconds, got '$BUDGET'"
[[ $PER_GPU =~ ^[1-9][0-9]*$ ]] || die "--per-gpu must be a positive integer, got '$PER_GPU'"
if [[ -n $DEVICE ]]; then
    GPUS=${GPUS:--}
elif [[ -z $GPUS ]]; then
    command -v nvidia-smi > /dev/null || die "no nvidia-smi: pass --gpus (CUDA device indices)"
    GPUS=$(seq -s ' ' 0 $(($(nvidia-smi -L | wc -l) - 1)))
fi
read -r -a GPU_LIST <<< "$GPUS"

if [[ $STAGE == train ]]; then
    arms=""
    for arm in $ARMS; do
        [[ $arm == gdn2 ]] && die "--arms: gdn2 has no lambda (its models are the shipped interference-gdn2-s<seed>)"
        arms+="$arm@$LAMBDA_MAX "
    done
    [[ -f $BASELINE/interference-gdn2-s0/tokenizer.json ]] || die "--baseline $BASELINE has no interference-gdn2-s0/tokenizer.json"
    exec "$HERE/train_checkpoints.sh" --recipe interference --runs "$OUT/runs" --ckpt "$OUT/ckpt" \
        --tokenizer "$BASELINE/interference-gdn2-s0" --arms "$arms" --seeds "$SEEDS" --prefix "$PREFIX" \
        --steps "$STEPS" --gpus "$GPUS" --python "$PY" \
        ${BUDGET:+--max-seconds "$BUDGET"} -- --theta-init "$THETA_INIT" --theta-lr-mult "$THETA_LR"
fi

[[ -d $OUT/ckpt ]] || die "no $OUT/ckpt: run the train stage first"
mapfile -t NAMES < <(cd "$OUT/ckpt" && ls -d -- "$PREFIX"*-s[0-9] 2> /dev/null)
((${#NAMES[@]})) || die "no $PREFIX*-s<seed> models in $OUT/ckpt"
JOBS=()  # "model-folder cell-folder strengths sweep-flags"
for name in "${NAMES[@]}"; do
    seed=${name##*-s}
    [[ -f $BASELINE/interference-gdn2-s$seed/config.json ]] || die "--baseline $BASELINE has no interference-gdn2-s$seed"
    for n in $NEEDLES; do
        for phase in $PHASES; do
            JOBS+=("$OUT/ckpt/$name|$OUT/eval/$name/mk$n-$phase|-1,0,0.5,1,1.5,2|--num-needles $n --phase $phase")
        done
        JOBS+=("$BASELINE/interference-gdn2-s$seed|$OUT/eval/gdn2-s$seed/mk$n|1|--num-needles $n")
    done
done
mapfile -t JOBS < <(printf '%s\n' "${JOBS[@]}" | sort -u)

sweep() {  # sweep "MODEL|OUT|STRENGTHS|FLAGS" DEVICE
    local model cell strengths flags
    IFS='|' read -r model cell strengths flags <<< "$1"
    mkdir -p "$(dirname "$cell")"
    # shellcheck disable=SC2086
    ${BUDGET:+timeout "$BUDGET"} $PY -m qedprobe.cli sweep --model "$model" --device "$2" --format legacy \
        --task mk-niah --haystack prose $flags --lengths "$LENGTHS" --strengths="$strengths" \
        --samples "$SAMPLES" --seed 0 --batch-tokens "$BATCH_TOKENS" --out "$cell" --no-progress >> "$cell.log" 2>&1 \
        || echo "stopped: $cell (see $cell.log; the same command resumes it)"
}

slots=$((${#GPU_LIST[@]} * PER_GPU))
for ((slot = 0; slot < slots; slot++)); do
    (for ((i = slot; i < ${#JOBS[@]}; i += slots)); do
        sweep "${JOBS[$i]}" "${DEVICE:-cuda:${GPU_LIST[$((slot % ${#GPU_LIST[@]}))]}}"
    done) &
done
wait
for name in "${NAMES[@]}"; do
    for n in $NEEDLES; do
        $PY -m qedprobe.cli report "$OUT/eval/gdn2-s${name##*-s}/mk$n" "$OUT/eval/$name/mk$n-all" \
            --labels "GDN-2,$name" --out "$OUT/reports/$name-mk$n" > /dev/null || echo "no report for $name mk$n"
    done
done
$PY "$HERE/strength_targets.py" "$OUT/eval" --training-length 2048 --figure "$OUT/strength-mk4.png" | tee "$OUT/targets.md"
