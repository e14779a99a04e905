#!/usr/bin/env bash
# One device call: our mixer against fla's GatedDeltaNet2 layer (same weights), then a reduced
# Table-4 sweep grid on a random 340M model. Wheels: `bash scripts/device_wheels.sh` here first;
# and the call: run(command="bash scripts/h200_model_checks.sh", carry=[".whl"]).
set -uo pipefail
source scripts/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python3 scripts/fla_layer_check.py --out "$OUT/fla_layer_check.json" 2>&1 | tee "$OUT/fla_layer_check.log"
timeout "${SWEEP_SECONDS:-300}" python3 bench/sweep.py --samples "${SWEEP_SAMPLES:-25}" --no-progress \
    --out /tmp/sweep 2>&1 | tee "$OUT/sweep_bench.log"
