#!/usr/bin/env bash
# One device call: qedprobe.hf on an H200 (scripts/h200_hf_check.py): at T = 4096 the adapted
# model (qed_chunk / qed_recurrent, Triton) against transformers' own PyTorch recurrence and
# against its fla path (forward and 16 greedy generate steps, float32), then bf16 prefill speed
# of the adapted model (with and without probes) against the fla and PyTorch paths. Random
# weights at a realistic width, built by transformers: nothing is downloaded.
#
# Wheels: `bash scripts/device_wheels.sh` here first (transformers 5.24 for Qwen3.5, Qwen3-Next and
# OLMo-Hybrid, transformer-lens, fla, qedprobe itself; the script stops if the installed
# transformers lacks those families). The call:
#   run(command="bash scripts/h200_hf_check.sh", carry=[".whl"])
# Environment: FAMILIES (default qwen3_5,olmo_hybrid; also qwen3_5_moe, qwen3_next), LENGTH
# (default 4096), BATCH (default 4), CHECK_SECONDS (default 540).
# Output: $OUT/hf_check.json, $OUT/hf_check.md (the tables for docs/BENCHMARKS.md), hf_check.log.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$REPO/scripts/device_env.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -P -c "import transformers.models.qwen3_5, transformers.models.olmo_hybrid, qedprobe.hf, fla; \
print('transformers', transformers.__version__)" || { echo "the installed transformers lacks Qwen3.5 / OLMo-Hybrid: carry transformers 5.24.0"; exit 1; }
# From /tmp, so that the installed wheel (with qedprobe.kernels) is imported, not the source folder.
cd /tmp && timeout "${CHECK_SECONDS:-540}" python3 "$REPO"/scripts/h200_hf_check.py --families "${FAMILIES:-qwen3_5,olmo_hybrid}" \
    --length "${LENGTH:-4096}" --batch "${BATCH:-4}" --out "$OUT" 2>&1 | tee "$OUT/hf_check.log" | tail -30
