#!/usr/bin/env bash
# The GPU check (checks/gpu/: FlashInfer vs torch attention parity, speculative decoding, CUDA graphs (verify, the
# head's catch-up over the verify rows, its draft steps), MLA, tree mask cost, chain attention, the training memory
# plan against real runs, the block drafters' grouped token loss and the Muon recipe, tensor parallelism)
# and tokens/s on a CUDA machine, every group in one run.
# Prints PASS/FAIL per check; exits non-zero if any check fails. Finishes in a few minutes on one H100/H200
# (the first FlashInfer use JIT-compiles its kernels).
#   bash launch/gpu_check.sh [--model models/smollm2-135m-instruct]
# Wheels placed in .whl/ (flashinfer-python and its pure-Python needs) are installed to a private folder
# first when FlashInfer is not importable (for machines without a package index).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if ! "$PY" -c "import flashinfer" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/mtp-gpu-site .whl/*.whl
  export PYTHONPATH=/tmp/mtp-gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
exec "$PY" -m checks.gpu "$@"  # every group of checks/gpu/ in one run
