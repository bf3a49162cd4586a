#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what the GPU check installs on a machine that has Python 3.12,
# CUDA torch, Triton and nvcc but no package registry: flashinfer 0.6.13 (pure Python, 14 MB:
# it compiles its kernels with nvcc at first use) and its import-time dependencies, fla-core
# (flash-linear-attention's Triton kernels: KDA), and what dflash-batch and its GPU tests import
# beyond torch. Under 64 MiB (the device tool's limit).
#   bash benchmarks/prepare_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl)
# flashinfer without its optional CUDA-Python, cuDNN and CUTLASS-DSL backends (hundreds of MB,
# unused by the prefill/sampling paths); apache-tvm-ffi is its FFI.
pip download -q --no-deps "${target[@]}" flashinfer-python==0.6.13 "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0" \
    fla-core==0.6.0
pip download -q "${target[@]}" einops ninja nvidia-ml-py requests tqdm tabulate click numpy packaging \
    pydantic pyyaml orjson safetensors pytest
du -sh .whl && ls .whl
