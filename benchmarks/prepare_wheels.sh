#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what the GPU check installs on the device: only the packages its
# image lacks (the image has CUDA torch 2.11, Triton 3.6, numpy, pytest, click, einops, ninja,
# requests, tqdm, safetensors, pyarrow, pyyaml, tokenizers, tiktoken, jinja2, typing-extensions,
# nvidia-ml-py: ../.library's device KINDS.md lists them). Each wheel is pinned and fetched without
# its dependencies, so nothing the image holds is replaced; gpu_check.sh installs them into a
# directory of their own (--target), never into the image's site-packages.
#   flashinfer-python 0.6.13   attention and MLA; pure Python (its kernels: prebuild_flashinfer.py)
#   apache-tvm-ffi             flashinfer's FFI (imported by flashinfer at import)
#   fla-core 0.6.0             flash-linear-attention's Triton kernels (Kimi-K3's KDA)
#   pydantic and its parts, orjson   dflash-batch's job schema and JSON
#   bash benchmarks/prepare_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2 fla-core==0.6.0 \
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 orjson==3.13.0 \
    2> >(grep -v "is ignored: it is neither" >&2)
du -sh .whl && ls .whl
