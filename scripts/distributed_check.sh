#!/usr/bin/env bash
# One GPU against N on a machine with several (README, "Several GPUs"):
#
#   scripts/distributed_check.sh --out DIR [--parts "sweep train eig tests"] [--ngpu N]
#       [--sweep-samples 20] [--train-steps 20] [--train-rows 16] [--python "python3 -P"]
#
# * sweep: the Table-4 grid of a random 340M model (bench/sweep.py) on 1 GPU and on N, with
#   --sweep-samples of the grid's 500 prompts per cell (bench/sweep.py's full_grid_s_estimate
#   scales a run to the full grid by prompt tokens); the rows and predictions compared;
# * train: DDP training of the 340M shape on 1 and N GPUs, the same global batch (--train-rows
#   rows of 2048 tokens a step, a multiple of N), --train-steps steps: tokens/s (the first 5 steps
#   left out) and the first steps' loss and gradient norm compared;
# * eig: sharded `qedprobe eig` of a small random model against one GPU (histograms and counts
#   equal, moments close);
# * tests: tests/test_distributed.py (gloo on CPU).
# N defaults to every GPU nvidia-smi lists. Writes OUT/sweep_<n>.json, OUT/train_<n>.log,
# OUT/compare.jsonl (scripts/dist_compare.py's verdicts), OUT/tests.log. Exit status 1 if any
# part fails or any comparison disagrees.
set -uo pipefail
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "distributed_check.sh: $*" >&2; exit 2; }

OUT="" PARTS="sweep train eig tests" NGPU="" SWEEP_SAMPLES=20 TRAIN_STEPS=20 TRAIN_ROWS=16 PY="python3 -P"
while (($#)); do
    case $1 in -h | --help) usage ;; esac
    [[ $# -ge 2 ]] || die "$1 needs a value"
    case $1 in
        --out) OUT=$2 ;; --parts) PARTS=$2 ;; --ngpu) NGPU=$2 ;; --sweep-samples) SWEEP_SAMPLES=$2 ;;
        --train-steps) TRAIN_STEPS=$2 ;; --train-rows) TRAIN_ROWS=$2 ;; --python) PY=$2 ;;
        *) die "unknown argument '$1' (--help lists them)" ;;
    esac
    shift 2
done
[[ -n $OUT ]] || die "--out DIR is required"
for part in $PARTS; do [[ " sweep train eig tests " == *" $part "* ]] || die "--parts: unknown part '$part'"; done
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
((NGPU >= 2)) || die "needs two GPUs or more (--ngpu $NGPU)"
((TRAIN_ROWS % NGPU == 0)) || die "--train-rows $TRAIN_ROWS is not a multiple of --ngpu $NGPU"
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
cd "$WORK" || exit 1  # a source checkout in the working directory is not imported
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
RUN="$PY -m torch.distributed.run --standalone"
status=0
compare() { $PY "$REPO/scripts/dist_compare.py" "$@" | tee -a "$OUT/compare.jsonl" || status=1; }

if [[ " $PARTS " == *" sweep "* ]]; then
    for n in 1 "$NGPU"; do
        $RUN --nproc_per_node="$n" "$REPO/bench/sweep.py" --samples "$SWEEP_SAMPLES" --no-progress \
            --out "$WORK/sweep_$n" > "$OUT/sweep_$n.json" || { echo "sweep on $n GPU(s) failed"; status=1; }
    done
    compare rows "$WORK/sweep_1" "$WORK/sweep_$NGPU"
fi
if [[ " $PARTS " == *" train "* ]]; then
    for n in 1 "$NGPU"; do
        $RUN --nproc_per_node="$n" -m qedprobe.cli train --preset small --hidden 1024 --layers 24 --heads 6 \
            --head-dim 128 --seq-len 2048 --batch-size "$TRAIN_ROWS" --accum 1 --steps "$TRAIN_STEPS" --warmup 1 \
            --decay 1 --save-every 100000 --print-every 10 --out "$WORK/train_$n" > "$OUT/train_$n.log" 2>&1 \
            || { echo "training on $n GPU(s) failed"; status=1; }
    done
    compare train "$WORK/train_1" "$WORK/train_$NGPU"
fi
if [[ " $PARTS " == *" eig "* ]]; then
    $PY - "$WORK/eig_model" <<'EOF' || status=1
import sys
import torch
from qedprobe.model import QEDConfig, QEDModel
torch.manual_seed(0)
QEDModel(QEDConfig(vocab_size=259, hidden_size=256, num_hidden_layers=4, num_heads=2, head_dim=64)).save_pretrained(sys.argv[1])
EOF
    for n in 1 "$NGPU"; do
        $RUN --nproc_per_node="$n" -m qedprobe.cli eig --model "$WORK/eig_model" --length 4K --samples 8 \
            --no-progress --out "$WORK/eig_$n" || status=1
    done
    compare eig "$WORK/eig_1" "$WORK/eig_$NGPU"
fi
if [[ " $PARTS " == *" tests "* ]]; then
    $PY -m pytest -q -p no:cacheprovider --rootdir . "$REPO/tests/test_distributed.py" > "$OUT/tests.log" 2>&1 || status=1
    tail -3 "$OUT/tests.log"
fi
exit $status
