#!/usr/bin/env bash
# Set up offload in the current Python environment, from nothing.
#   tools/setup.sh          the package
#   tools/setup.sh test     + test dependencies
#   tools/setup.sh examples + what the examples need (transformers, safetensors, accelerate)
#   tools/setup.sh bench    + what the benchmarks need (transformers, accelerate, fio)
#   tools/setup.sh peers    + DeepSpeed too, to compare against (its ops JIT-build on first use)
#
# torch goes in first and only if missing: `pip install torch==2.13.0` takes the local CPU
# wheel on a CPU machine and the standard (CUDA) build from PyPI on a GPU machine, and an
# existing torch (e.g. a CUDA build) is never replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
what=${1:-}

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
case "$what" in
  test)  "$PY" -m pip install --quiet -e ".[test]" ;;
  examples) "$PY" -m pip install --quiet -e ".[examples]" ;;
  bench|peers) "$PY" -m pip install --quiet -e ".[bench]" ;;
  "")    "$PY" -m pip install --quiet -e . ;;
  *) echo "usage: tools/setup.sh [test|examples|bench|peers]" >&2; exit 2 ;;
esac

if [ "$what" = bench ] || [ "$what" = peers ]; then
  if ! command -v fio >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      (apt-get update -qq && apt-get install -y -qq fio libaio-dev) >/dev/null \
        || echo "setup: could not install fio; the benchmark will skip the fio comparison" >&2
    else
      echo "setup: fio is missing (apt-get install fio); the benchmark will skip it" >&2
    fi
  fi
fi
if [ "$what" = peers ]; then
  # DeepSpeed is a peer for comparison only, never a dependency of offload.
  if ! "$PY" -c "import deepspeed" 2>/dev/null; then
    "$PY" -m pip install --quiet --no-build-isolation deepspeed \
      || echo "setup: DeepSpeed did not install; the benchmark will skip it" >&2
  fi
fi
