#!/usr/bin/env bash
# One device call: our mixer against fla's GatedDeltaNet2 layer (same weights), then a reduced
# Table-4 sweep grid on a random 340M model. Expects the wheels in .whl_tl/ (see docs/BENCHMARKS.md).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_tl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python3 bench/fla_layer_check.py --out "$OUT/fla_layer_check.json" 2>&1 | tee "$OUT/fla_layer_check.log"
timeout "${SWEEP_SECONDS:-300}" python3 bench/sweep.py --samples "${SWEEP_SAMPLES:-25}" --no-progress \
    --out /tmp/sweep 2>&1 | tee "$OUT/sweep_bench.log"
