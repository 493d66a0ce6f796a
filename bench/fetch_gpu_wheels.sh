#!/usr/bin/env bash
# Download, on the development machine, the wheels bench/gpu_check.sh installs on a lent GPU
# machine (which reaches no package registry). Its image has torch (CUDA), transformers,
# onnx and pytest, but not diffusers. Wheels land in .whl/ (git-ignored) and travel with
# the device call's `carry: [".whl"]`.
#
# TensorRT cannot travel this way: PyPI's tensorrt-cu12/-cu13(-libs) are stub sdists that
# fetch the real wheels from NVIDIA's own index at install time (unreachable from here and
# from the GPU machine), and the real libraries are over 1 GB, past the 64 MiB a device
# call carries. gpu_check.sh therefore uses TensorRT only where the machine already has it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
# The GPU image's interpreter is CPython 3.12 on x86-64.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "diffusers==0.42.1" "importlib_metadata==10.2.0"
ls -l .whl
