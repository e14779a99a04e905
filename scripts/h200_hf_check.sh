#!/usr/bin/env bash
# One device call: qedprobe.hf on an H200 (scripts/h200_hf_check.py): at T = 4096 the adapted
# model (qed_chunk / qed_recurrent, Triton) against transformers' own PyTorch recurrence and
# against its fla path (forward and 16 greedy generate steps, float32), then bf16 prefill speed
# of the adapted model (with and without probes) against the fla and PyTorch paths. Random
# weights at a realistic width, built by transformers: nothing is downloaded.
#
# Wheels to carry (.whl_tl/, git-excluded; the device reaches no network): the set of
# scripts/h200_model_checks.sh (transformer-lens 4.3.0 and its pure-Python dependencies,
# flash-linear-attention and fla-core 0.6.0, qedprobe itself: `pip wheel --no-deps -w .whl_tl .`
# after every change) PLUS transformers 5.24.0 and what it pins, made here with
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl_tl \
#     transformers==5.24.0 huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 typer==0.29.2
# (Qwen3.5, Qwen3-Next and OLMo-Hybrid need a recent transformers; the script stops if the
# installed one lacks them). The call:
#   run(command="bash scripts/h200_hf_check.sh", carry=[".whl_tl"])
# Environment: FAMILIES (default qwen3_5,olmo_hybrid; also qwen3_5_moe, qwen3_next), LENGTH
# (default 4096), BATCH (default 4), CHECK_SECONDS (default 540).
# Output: $OUT/hf_check.json, $OUT/hf_check.md (the tables for docs/BENCHMARKS.md), hf_check.log.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$REPO"/.whl_tl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -P -c "import transformers.models.qwen3_5, transformers.models.olmo_hybrid, qedprobe.hf, fla; \
print('transformers', transformers.__version__)" || { echo "the installed transformers lacks Qwen3.5 / OLMo-Hybrid: carry transformers 5.24.0"; exit 1; }
# From /tmp, so that the installed wheel (with qedprobe.kernels) is imported, not the source folder.
cd /tmp && timeout "${CHECK_SECONDS:-540}" python3 "$REPO"/scripts/h200_hf_check.py --families "${FAMILIES:-qwen3_5,olmo_hybrid}" \
    --length "${LENGTH:-4096}" --batch "${BATCH:-4}" --out "$OUT" 2>&1 | tee "$OUT/hf_check.log" | tail -30
