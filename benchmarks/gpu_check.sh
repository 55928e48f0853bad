#!/usr/bin/env bash
# benchmarks/gpu_check.py on the device machine, with the packages its image lacks (docs/benchmarks.md).
#
#   bash benchmarks/gpu_check.sh wheels   # here, once: kronfluence 1.0.1 + einconv wheels into .whl/ (git-ignored)
#   bash benchmarks/gpu_check.sh [ARGS]   # there: installs .whl/*.whl into /tmp/site, runs the check, files in $OUT
#
# The device image has torch, torchvision, pytest, accelerate, einops, opt-einsum, safetensors and
# tqdm, but no kronfluence/einconv and no Ray: the kronfluence phase needs the carried wheels, the
# CUDA tests that need Ray are skipped (the JSON says so). ARGS go to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = wheels ]; then
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
  "${PY:-.venv/bin/python}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl kronfluence==1.0.1 einconv==0.1.0
  exit 0
fi
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  rm -rf /tmp/site/tests /tmp/site/examples  # kronfluence's wheel ships these top-level folders too
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
(nvidia-smi; python3 -m pip list 2>/dev/null) > "$OUT/machine.txt" 2>&1 || true
python3 benchmarks/gpu_check.py --out "$OUT/gpu_check.json" "$@" 2>&1 | tee "$OUT/gpu_check.log"
