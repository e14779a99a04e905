#!/usr/bin/env bash
# Make .whl/ (git-ignored): every wheel qedprobe needs on a GPU machine that reaches no package
# index, for Python 3.12 on x86-64 Linux (docs/BENCHMARKS.md, "Running on a rented GPU machine").
# Run it where an index is reachable, in the repository's root, after every change to qedprobe
# (its own wheel is rebuilt each time); copy .whl/ to the GPU machine with the working tree and
# `source scripts/device_env.sh` there. The machine is expected to have torch, triton, numpy,
# safetensors, tokenizers, huggingface_hub 1.x, tqdm and typer (as CUDA images with PyTorch do);
# transformers 5.24 accepts that huggingface_hub, so no hub wheel (2.x would need httpx2). About
# 24 MB. .whl/BUILD names the commit of the qedprobe wheel.
#
# With --flashqla it also fetches FlashQLA (Qwen's TileLang kernels, which fla 0.6 routes
# chunk_gated_delta_rule to when importable) and its dependencies, 80 MB, in two folders that fit
# one device call each: .whl-flashqla/1 (tilelang alone) and .whl-flashqla/2 (the rest). On a warm
# machine: one call carrying .whl-flashqla/1 copies it to a folder there (e.g. /tmp/staged), the
# next carrying .whl and .whl-flashqla/2 copies that too and runs with QEDPROBE_EXTRA_WHEELS set to
# the folder before `source scripts/device_env.sh` (docs/BENCHMARKS.md, "Real-model gates").
set -euo pipefail
cd "$(dirname "$0")/.."
download() {  # download DIR SPEC...: binary wheels for CPython 3.12 on x86-64 Linux, no dependencies
    local dir=$1; shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform any -d "$dir" "$@"
}
if [[ ${1:-} == --flashqla ]]; then
    mkdir -p .whl-flashqla/1 .whl-flashqla/2
    download .whl-flashqla/1 tilelang==0.1.15
    download .whl-flashqla/2 flash-qla==0.1.3 apache-tvm-ffi==0.1.12 z3-solver==4.15.4.0 torch-c-dlpack-ext==0.1.5 \
        cloudpickle==3.1.3 ml-dtypes==0.7.0 psutil==7.2.2
elif [[ -n ${1:-} ]]; then
    echo "scripts/device_wheels.sh: unknown argument '$1'; expected nothing or --flashqla" >&2
    exit 2
fi
mkdir -p .whl
rm -f .whl/qedprobe-*.whl
download .whl \
    transformer-lens==4.3.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 beartype==0.23.1 \
    typeguard==4.6.1 fancy-einsum==0.0.3 flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2 \
    transformers==5.24.0 wonderwords==3.0.1
python3 -m pip wheel -q --no-deps -w .whl .
rm -rf build
# The commit the qedprobe wheel was built from ("-dirty" with uncommitted changes): a copy of the
# repository on the GPU machine may carry a stale .git, so scripts/device_env.sh reads this instead.
git describe --always --dirty --abbrev=7 > .whl/BUILD
ls .whl
