#!/usr/bin/env bash
# Download the wheels the GPU check needs that its machine lacks (it has no network) into gpu_wheels/:
# fla-core (the prefill kernels) and rwkv (the peer), for python 3.12 on x86_64 Linux, no dependencies.
# Carry gpu_wheels/ with the tree; benchmarks/gpu_check.sh installs them with --no-index.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p gpu_wheels
for pkg in fla-core==0.6.0 rwkv==0.8.32; do
    python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d gpu_wheels "$pkg"
done
ls -l gpu_wheels
