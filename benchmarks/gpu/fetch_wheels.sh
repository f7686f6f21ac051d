#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with benchmarks/gpu/wheels.txt's wheels for the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
grep -v '^#' benchmarks/gpu/wheels.txt | grep . | xargs python3 -m pip download -q --no-deps \
  --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64
du -sh .whl
