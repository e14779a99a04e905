#!/usr/bin/env bash
# Make .whl/ (git-ignored): every wheel qedprobe needs on a GPU machine that reaches no package
# index, for Python 3.12 on x86-64 Linux (docs/BENCHMARKS.md, "Running on a rented GPU machine").
# Run it where an index is reachable, in the repository's root, after every change to qedprobe
# (its own wheel is rebuilt each time); copy .whl/ to the GPU machine with the working tree and
# `source scripts/device_env.sh` there. The machine is expected to have torch, triton, numpy,
# safetensors, tokenizers, huggingface_hub 1.x, tqdm and typer (as CUDA images with PyTorch do);
# transformers 5.24 accepts that huggingface_hub, so no hub wheel (2.x would need httpx2). About
# 24 MB. .whl/BUILD names the commit of the qedprobe wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/qedprobe-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
    transformer-lens==4.3.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 beartype==0.23.1 \
    typeguard==4.6.1 fancy-einsum==0.0.3 flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2 \
    transformers==5.24.0 wonderwords==3.0.1
python3 -m pip wheel -q --no-deps -w .whl .
rm -rf build
# The commit the qedprobe wheel was built from ("-dirty" with uncommitted changes): a copy of the
# repository on the GPU machine may carry a stale .git, so scripts/device_env.sh reads this instead.
git describe --always --dirty --abbrev=7 > .whl/BUILD
ls .whl
