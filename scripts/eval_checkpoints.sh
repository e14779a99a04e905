#!/usr/bin/env bash
# Measure a family of checkpoints (docs/RESULTS.md), several sweeps at once per GPU:
#
#   scripts/eval_checkpoints.sh --ckpt DIR --out DIR [--cells recall|interference] [--only "NAME ..."]
#       [--samples 100] [--lengths 1K,2K,...] [--strength-arms "full noproj"] [--gpus "0 1"]
#       [--per-gpu 3] [--device cpu] [--format legacy|ruler] [--python "python3 -P"]
#
# For every checkpoint <name> of --ckpt (every `*-s<seed>` folder, or the --only names):
# * each cell of the --cells set at every length, s = 1 (`qedprobe sweep`, into OUT/<name>/<cell>/);
# * on the first cell of a checkpoint whose arm is in --strength-arms, the Table-4 strength sweep,
#   s in -1, 0, 0.5, 1, 1.5, 2, on the same prompts;
# * every arm but gdn2: `qedprobe eig` (e_t, rho, ||S^T d|| histograms and ranges; OUT/<name>/eig/).
# Cell sets:
# * recall (default): S-NIAH-1 (`sweep`) at 1K-16K; strength sweep on arm full; eig on S-NIAH-1 at
#   2K (the shipped `recall-*`);
# * interference: MK-NIAH with 4 needles in prose and noise haystacks (mk4-prose, mk4-noise),
#   with 8 and 16 needles in prose (mk8-prose; mk16-prose at 2K and 8K), the foreign-key control
#   of mk4-prose (mk4-prose-control at 2K and 8K: the asked key is in no needle, so a model that
#   matches keys falls to <= 25 %), S-NIAH-1/2/3 (s1, s2, s3), at 2K-32K; strength sweeps on arms
#   full and noproj; eig on MK-NIAH at 2K (the shipped `interference-*`).
# Every sweep uses --seed 0, so prompt i at length L is the same for every checkpoint and strength
# and `qedprobe report` pairs arms on shared prompts. The task format is --format, else the one
# each checkpoint's config.json records as task_format, else ruler. Each sweep resumes: run the
# same command again to finish what a cut call left. Logs: OUT/<name>.log.
set -euo pipefail
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "eval_checkpoints.sh: $*" >&2; exit 2; }

CELLS_SET=recall CKPT="" OUT="" ONLY="" SAMPLES=100 LENGTHS="" STRENGTH_ARMS="" GPUS="" PER_GPU=3
DEVICE="" FORMAT="" PY="python3 -P"
while (($#)); do
    case $1 in -h | --help) usage ;; esac
    [[ $# -ge 2 ]] || die "$1 needs a value"
    case $1 in
        --cells) CELLS_SET=$2 ;; --ckpt) CKPT=$2 ;; --out) OUT=$2 ;; --only) ONLY=$2 ;;
        --samples) SAMPLES=$2 ;; --lengths) LENGTHS=$2 ;; --strength-arms) STRENGTH_ARMS=$2 ;;
        --gpus) GPUS=$2 ;; --per-gpu) PER_GPU=$2 ;; --device) DEVICE=$2 ;; --format) FORMAT=$2 ;;
        --python) PY=$2 ;;
        *) die "unknown argument '$1' (--help lists them)" ;;
    esac
    shift 2
done
[[ -n $CKPT && -n $OUT ]] || die "--ckpt DIR and --out DIR are required (model folders, output folder)"
[[ -d $CKPT ]] || die "--ckpt $CKPT is not a folder"
[[ $PER_GPU =~ ^[1-9][0-9]*$ ]] || die "--per-gpu must be a positive integer, got '$PER_GPU'"
MK="--task mk-niah --num-needles"
case $CELLS_SET in
    recall) CELLS=("sweep|--task s-niah-1") EIG="--task s-niah-1 --length 2K"
            : "${LENGTHS:=1K,2K,4K,8K,16K}" "${STRENGTH_ARMS:=full}" ;;
    interference) CELLS=("mk4-prose|$MK 4 --haystack prose" "mk4-noise|$MK 4 --haystack noise"
                         "mk8-prose|$MK 8 --haystack prose" "mk16-prose|$MK 16 --haystack prose --lengths 2K,8K"
                         "mk4-prose-control|$MK 4 --haystack prose --control foreign-key --lengths 2K,8K"
                         "s1|--task s-niah-1" "s2|--task s-niah-2" "s3|--task s-niah-3")
                  EIG="--task mk-niah --length 2K"
                  : "${LENGTHS:=2K,4K,8K,16K,32K}" "${STRENGTH_ARMS:=full noproj}" ;;
    *) die "--cells must be recall or interference, got '$CELLS_SET'" ;;
esac
if [[ -n $DEVICE ]]; then
    GPU_LIST=(-)
else
    if [[ -z $GPUS ]]; then
        command -v nvidia-smi > /dev/null || die "no nvidia-smi: pass --gpus (CUDA device indices) or --device cpu"
        GPUS=$(seq -s ' ' 0 $(($(nvidia-smi -L | wc -l) - 1)))
    fi
    read -r -a GPU_LIST <<< "$GPUS"
fi
if [[ -n $ONLY ]]; then read -r -a NAMES <<< "$ONLY"; else
    mapfile -t NAMES < <(cd "$CKPT" && ls -d -- *-s[0-9] 2> /dev/null); fi
((${#NAMES[@]})) || die "no checkpoints (*-s<seed> folders) in $CKPT"
for name in "${NAMES[@]}"; do [[ -f $CKPT/$name/config.json ]] || die "$CKPT/$name has no config.json"; done
mkdir -p "$OUT"

config_field() {  # config_field NAME KEY DEFAULT: a field of the checkpoint's config.json
    $PY -c 'import json, sys; print(json.load(open(sys.argv[1])).get(sys.argv[2]) or sys.argv[3])' \
        "$CKPT/$1/config.json" "$2" "$3"
}

evaluate() {  # evaluate NAME DEVICE: every cell, the strength sweep on the first, then eig
    local name=$1 device=$2 arm fmt i cell flags s
    arm=$(config_field "$name" arm unknown)
    fmt=${FORMAT:-$(config_field "$name" task_format ruler)}
    for i in "${!CELLS[@]}"; do
        IFS='|' read -r cell flags <<< "${CELLS[$i]}"
        s=1
        [[ $i == 0 && " $STRENGTH_ARMS " == *" $arm "* ]] && s=-1,0,0.5,1,1.5,2
        # shellcheck disable=SC2086
        $PY -m qedprobe.cli sweep --model "$CKPT/$name" --device "$device" --format "$fmt" --lengths "$LENGTHS" \
            $flags --strengths="$s" --samples "$SAMPLES" --seed 0 --out "$OUT/$name/$cell" --no-progress || return 1
    done
    [[ $arm == gdn2 ]] && return 0
    # shellcheck disable=SC2086
    $PY -m qedprobe.cli eig --model "$CKPT/$name" --device "$device" --format "$fmt" $EIG --samples 16 --seed 0 \
        --out "$OUT/$name/eig" --no-progress
}

slots=$((${#GPU_LIST[@]} * PER_GPU))
for ((slot = 0; slot < slots; slot++)); do
    (for ((i = slot; i < ${#NAMES[@]}; i += slots)); do
        gpu=${GPU_LIST[$((slot % ${#GPU_LIST[@]}))]}
        device=${DEVICE:-cuda:$gpu}
        echo "$device ${NAMES[$i]}"
        evaluate "${NAMES[$i]}" "$device" > "$OUT/${NAMES[$i]}.log" 2>&1 || echo "FAILED ${NAMES[$i]} (see $OUT/${NAMES[$i]}.log)"
    done) &
done
wait
