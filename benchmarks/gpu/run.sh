#!/usr/bin/env bash
# The GPU kit in one command, on the GPU machine (Python 3.12, the image's jax 0.11.2 + CUDA 13
# plugin, torch, transformers; no network):
#   bash benchmarks/gpu/run.sh OUT [kit.py flags, e.g. --stages kernels,tests]
# Installs the wheels carried in .whl/ (benchmarks/gpu/wheels.txt; fetch_wheels.sh fills it)
# with --no-deps into /tmp/moe_jax_site, ahead of the image's packages, then runs kit.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: bash benchmarks/gpu/run.sh OUT_DIR [--dry-run] [--stages a,b] [--budget S]}
shift
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/moe_jax_site .whl/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
  export PYTHONPATH=/tmp/moe_jax_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec python3 benchmarks/gpu/kit.py "$OUT" "$@"
