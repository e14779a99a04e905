#!/usr/bin/env bash
# Train a family of checkpoints, arms x seeds of one recipe, several runs at once per GPU:
#
#   scripts/train_checkpoints.sh --runs DIR --ckpt DIR [--recipe interference|recall|fla-start]
#       [--arms "gdn2 full noproj full@1.0"] [--seeds "0 1 2"] [--prefix interference-] [--steps N]
#       [--gpus "0 1"] [--per-gpu N] [--tokenizer DIR] [--max-seconds S] [--python "python3 -P"]
#       [-- MORE qedprobe train FLAGS]
#
# Recipes (docs/TRAINING.md; the shipped checkpoints and their measurements: docs/RESULTS.md), all
# on the `small` shape (hidden 256, 4 layers, 2 heads of 128, MLP ratio 2), AdamW, WSD with 100
# warmup steps and the last 20 % of the steps decaying, theta's learning rate at 10x:
# * interference (default): MK-NIAH with 2-4 needles in noise and prose plus S-NIAH-1, rows of
#   2048 BPE tokens, 16 rows a step, the answer loss with the key-dependent tokens weighted 8, the
#   long-memory decay start, short convolutions of width 8; the tokenizer of `qedprobe
#   train-tokenizer --mixture interference --vocab-size 2048 --seq-len 8192 --rows 1000 --seed 0`,
#   trained into --tokenizer first when that folder has none (default RUNS/tokenizer);
#   default 1200 steps (the shipped `interference-*`);
# * recall: S-NIAH-1/2 and 2-needle MK-NIAH in rows of 1024 bytes, 32 rows a step, the answer
#   loss, the long-memory decay start; default 2900 steps (the shipped `recall-*`);
# * fla-start: mixture niah, the language-model loss, fla's decay start; default 850 steps (the
#   retired twelve `<arm>-s<seed>` models, which retrieve nothing).
# Flags after `--` go to every `qedprobe train` last, so they override the recipe's.
#
# Each run is <prefix><arm>-s<seed>, or <prefix><arm>-lm<L>-s<seed> for an --arms entry
# <arm>@<L> (trained with --lambda-max L): its run folder RUNS/<name>/ (fp32 checkpoints,
# loss.jsonl, train.log, stdout.log) and the frozen bf16 model with its MODEL_CARD.md in
# CKPT/<name>/. The runs are dealt round-robin over --gpus (default: every GPU nvidia-smi lists);
# each GPU runs --per-gpu of its share at once (default: all of it; a model this small leaves
# most of a GPU idle, and CUDA MPS, `nvidia-cuda-mps-control -d`, lets the processes' kernels
# overlap), the rest after them. Everything resumes: a run cut (--max-seconds, a lost machine)
# continues from its last checkpoint when the same command runs again, and a finished run (its
# model card exists) is skipped. Prints one summary line per run at the end.
set -euo pipefail
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "train_checkpoints.sh: $*" >&2; exit 2; }

RECIPE=interference RUNS="" CKPT="" ARMS="" SEEDS="" PREFIX="" STEPS="" GPUS="" PER_GPU="" TOK=""
MAX_SECONDS="" PY="python3 -P" MORE=()
while (($#)); do
    case $1 in
        -h | --help) usage ;;
        --) shift; MORE=("$@"); break ;;
    esac
    [[ $# -ge 2 ]] || die "$1 needs a value"
    case $1 in
        --recipe) RECIPE=$2 ;; --runs) RUNS=$2 ;; --ckpt) CKPT=$2 ;; --arms) ARMS=$2 ;;
        --seeds) SEEDS=$2 ;; --prefix) PREFIX=$2 ;; --steps) STEPS=$2 ;; --gpus) GPUS=$2 ;;
        --per-gpu) PER_GPU=$2 ;; --tokenizer) TOK=$2 ;; --max-seconds) MAX_SECONDS=$2 ;;
        --python) PY=$2 ;;
        *) die "unknown argument '$1' (--help lists them)" ;;
    esac
    shift 2
done
[[ -n $RUNS && -n $CKPT ]] || die "--runs DIR and --ckpt DIR are required (run folders, model folders)"
case $RECIPE in
    interference) RECIPE_FLAGS=(--mixture interference-short --seq-len 2048 --batch-size 16 --loss answer
                      --key-weight 8 --decay-a 0.5,2 --decay-dt 0.0001,0.1 --conv-size 8)
                  : "${STEPS:=1200}" "${ARMS:=gdn2 full noproj full@1.0}" "${SEEDS:=0 1 2}" ;;
    recall) RECIPE_FLAGS=(--mixture short --loss answer --decay-a 0.5,2 --decay-dt 0.0001,0.1)
            : "${STEPS:=2900}" "${ARMS:=gdn2 full}" "${SEEDS:=0 1}" ;;
    fla-start) RECIPE_FLAGS=(--mixture niah)
               : "${STEPS:=850}" "${ARMS:=gdn2 nogate_noproj nogate full rand noproj}" "${SEEDS:=0 1}" ;;
    *) die "--recipe must be interference, recall or fla-start, got '$RECIPE'" ;;
esac
[[ $STEPS =~ ^[1-9][0-9]*$ ]] || die "--steps must be a positive integer, got '$STEPS'"
[[ -z $PER_GPU || $PER_GPU =~ ^[1-9][0-9]*$ ]] || die "--per-gpu must be a positive integer, got '$PER_GPU'"
if [[ -z $GPUS ]]; then
    command -v nvidia-smi > /dev/null || die "no nvidia-smi: pass --gpus (CUDA device indices)"
    GPUS=$(seq -s ' ' 0 $(($(nvidia-smi -L | wc -l) - 1)))
fi
read -r -a GPU_LIST <<< "$GPUS"
read -r -a ARM_LIST <<< "$ARMS"
read -r -a SEED_LIST <<< "$SEEDS"
mkdir -p "$RUNS" "$CKPT"
if [[ $RECIPE == interference ]]; then
    TOK=${TOK:-$RUNS/tokenizer}
    [[ -f $TOK/tokenizer.json ]] || $PY -m qedprobe.cli train-tokenizer --mixture interference \
        --vocab-size 2048 --seq-len 8192 --rows 1000 --seed 0 --out "$TOK"
    RECIPE_FLAGS+=(--tokenizer "$TOK")
fi
SCHEDULE=(--steps "$STEPS" --warmup 100 --decay $((STEPS / 5)) --save-every $((STEPS < 500 ? STEPS : 500)))
[[ -n $MAX_SECONDS ]] && SCHEDULE+=(--max-seconds "$MAX_SECONDS")

JOBS=()
for seed in "${SEED_LIST[@]}"; do for arm in "${ARM_LIST[@]}"; do JOBS+=("$arm $seed"); done; done
NGPU=${#GPU_LIST[@]}
PER_GPU=${PER_GPU:-$(((${#JOBS[@]} + NGPU - 1) / NGPU))}

train_one() {  # train_one ARM_ENTRY SEED GPU: one run, skipped when its model card exists
    local entry=$1 seed=$2 gpu=$3 arm=${1%@*} name lam=()
    name=$PREFIX$arm-s$seed
    [[ $entry == *@* ]] && { lam=(--lambda-max "${entry#*@}"); name=$PREFIX$arm-lm${entry#*@}-s$seed; }
    [[ -f $CKPT/$name/MODEL_CARD.md ]] && { echo "skip $name (done)"; return; }
    echo "GPU $gpu: $name"
    mkdir -p "$RUNS/$name"
    CUDA_VISIBLE_DEVICES=$gpu $PY -m qedprobe.cli train --preset small --arm "$arm" --seed "$seed" "${lam[@]}" \
        "${RECIPE_FLAGS[@]}" "${SCHEDULE[@]}" --out "$RUNS/$name" --export "$CKPT/$name" --print-every 100 \
        --no-progress "${MORE[@]}" >> "$RUNS/$name/stdout.log" 2>&1 || echo "FAILED $name (see $RUNS/$name/stdout.log)"
}

run_slot() {  # run_slot G SLOT: jobs i with i % NGPU == G and (i / NGPU) % PER_GPU == SLOT, in turn
    local i entry seed
    for ((i = $1 + $2 * NGPU; i < ${#JOBS[@]}; i += NGPU * PER_GPU)); do
        read -r entry seed <<< "${JOBS[$i]}"
        train_one "$entry" "$seed" "${GPU_LIST[$1]}"
    done
}

for ((g = 0; g < NGPU; g++)); do for ((s = 0; s < PER_GPU; s++)); do run_slot "$g" "$s" & done; done
wait
$PY - "$CKPT" "$RUNS" <<'PY'
import json, pathlib, statistics, sys
ckpt, runs = map(pathlib.Path, sys.argv[1:])
for d in sorted(p for p in runs.iterdir() if (p / "loss.jsonl").is_file()):
    log = [json.loads(line) for line in (d / "loss.jsonl").open()]
    done = (ckpt / d.name / "MODEL_CARD.md").is_file()
    step_s = statistics.median(r["step_s"] for r in log[len(log) // 4:]) if log else float("nan")
    loss = log[-1]["loss"] if log else float("nan")
    print(f"{d.name:28s} {'done' if done else 'unfinished':10s} steps {len(log):5d}  {step_s:6.3f} s/step  loss {loss:.4f}")
PY
