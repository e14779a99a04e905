#!/usr/bin/env bash
# One device call: our mixer against fla's GatedDeltaNet2 layer (same weights), then a reduced
# Table-4 sweep grid on a random 340M model. Expects the wheels in .whl_tl/ (git-excluded), made here with
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl_tl \
#     transformer-lens==4.3.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 beartype==0.23.1 \
#     typeguard==4.6.1 fancy-einsum==0.0.3 flash-linear-attention==0.6.0 fla-core==0.6.0
#   pip wheel --no-deps -w .whl_tl .      # qedprobe itself (rebuild after every change)
# and the call: run(command="bash scripts/h200_model_checks.sh", carry=[".whl_tl"]).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_tl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python3 scripts/fla_layer_check.py --out "$OUT/fla_layer_check.json" 2>&1 | tee "$OUT/fla_layer_check.log"
timeout "${SWEEP_SECONDS:-300}" python3 bench/sweep.py --samples "${SWEEP_SAMPLES:-25}" --no-progress \
    --out /tmp/sweep 2>&1 | tee "$OUT/sweep_bench.log"
