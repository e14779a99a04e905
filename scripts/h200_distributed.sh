#!/usr/bin/env bash
# One device call on a machine of several GPUs (issue #17): the Table-4 sweep grid of a random
# 340M model (bench/sweep.py) on 1 GPU and on all N, with the rows compared; DDP training
# tokens/s on 1 vs N GPUs (340M shape, the same global batch), with the first steps' loss and
# gradient norm compared; sharded eig over NCCL against one GPU; the CPU (gloo) tests of
# tests/test_distributed.py.
#   run(command="bash scripts/h200_distributed.sh", carry=[".whl"], kind="nvidia-h200-x2")
# does all of it with small defaults inside one 10-minute call; for the measurement proper, one
# call per part with more work, e.g.
#   PARTS=sweep SWEEP_SAMPLES=100 bash scripts/h200_distributed.sh      (about 5 + 5/N minutes)
#   PARTS=train TRAIN_STEPS=60 bash scripts/h200_distributed.sh
#   PARTS="eig tests" bash scripts/h200_distributed.sh
# Wheels: `bash scripts/device_wheels.sh` here first (.whl/, with qedprobe's own wheel).
# Environment: PARTS (default "sweep train eig tests"), NGPU (default: every GPU),
# TOTAL_SECONDS (default 540: every run is cut at that deadline), SWEEP_SAMPLES (default 20 of
# the grid's 500; bench/sweep.py's full_grid_s_estimate scales a run to the full grid by prompt tokens),
# TRAIN_STEPS (default 20; tokens/s leaves out the first 5), TRAIN_ROWS (global rows of 2048
# tokens per step, default 16, a multiple of NGPU).
# Everything runs from /tmp so that the installed package (with qedprobe.kernels) is imported.
# Results go to $OUT: sweep_1.json, sweep_N.json, train_1.log, train_N.log, compare.jsonl, tests.log.
set -uo pipefail
DEADLINE=$(( $(date +%s) + ${TOTAL_SECONDS:-540} ))
left() { echo $(( DEADLINE - $(date +%s) > 1 ? DEADLINE - $(date +%s) : 1 )); }
REPO=$(cd "$(dirname "$0")/.." && pwd)
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$REPO/scripts/device_env.sh" || exit 1
cd /tmp && python3 -c "import qedprobe.dist, qedprobe.kernels, transformer_lens" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
RUN="python3 -m torch.distributed.run --standalone"
PARTS=${PARTS:-sweep train eig tests}
status=0
compare() { python3 "$REPO"/scripts/dist_compare.py "$@" | tee -a "$OUT/compare.jsonl" || status=1; }

if [[ " $PARTS " == *" sweep "* ]]; then
    for n in 1 "$NGPU"; do
        rm -rf "/tmp/sweep_$n"
        timeout "$(left)" $RUN --nproc_per_node="$n" "$REPO"/bench/sweep.py \
            --samples "${SWEEP_SAMPLES:-20}" --no-progress --out "/tmp/sweep_$n" > "$OUT/sweep_$n.json" \
            || { echo "sweep on $n GPU(s) failed or timed out"; status=1; }
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], 'GPU(s):', \
{k: r[k] for k in ('ranks', 'rows', 'wall_s', 'prompt_tokens_per_s', 'full_grid_s_estimate')})" \
            "$OUT/sweep_$n.json" "$n" || status=1
    done
    compare rows /tmp/sweep_1 "/tmp/sweep_$NGPU"
fi

if [[ " $PARTS " == *" train "* ]]; then
    rows=${TRAIN_ROWS:-16}
    for n in 1 "$NGPU"; do
        rm -rf "/tmp/train_$n"
        timeout "$(left)" $RUN --nproc_per_node="$n" -m qedprobe.cli train --preset small \
            --hidden 1024 --layers 24 --heads 6 --head-dim 128 --seq-len 2048 --batch-size "$rows" --accum 1 \
            --steps "${TRAIN_STEPS:-20}" --warmup 1 --decay 1 --save-every 100000 --print-every 10 \
            --out "/tmp/train_$n" > "$OUT/train_$n.log" 2>&1 || { echo "training on $n GPU(s) failed"; status=1; }
        tail -3 "$OUT/train_$n.log"
    done
    compare train /tmp/train_1 "/tmp/train_$NGPU"
fi

if [[ " $PARTS " == *" eig "* ]]; then
    python3 - <<'EOF' || status=1
import torch
from qedprobe.model import QEDConfig, QEDModel
torch.manual_seed(0)
QEDModel(QEDConfig(vocab_size=259, hidden_size=256, num_hidden_layers=4, num_heads=2, head_dim=64)).save_pretrained("/tmp/eig_model")
EOF
    for n in 1 "$NGPU"; do
        timeout "$(left)" $RUN --nproc_per_node="$n" -m qedprobe.cli eig --model /tmp/eig_model --length 4K \
            --samples 8 --no-progress --out "/tmp/eig_$n" || status=1
    done
    compare eig /tmp/eig_1 "/tmp/eig_$NGPU"
fi

if [[ " $PARTS " == *" tests "* ]]; then
    timeout "$(left)" python3 -m pytest -q -p no:cacheprovider --rootdir /tmp "$REPO"/tests/test_distributed.py \
        2>&1 | tee "$OUT/tests.log" | tail -5
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
exit $status
