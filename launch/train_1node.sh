#!/usr/bin/env bash
# mtp-train on one node: torchrun starts one process per GPU; every argument is a Hydra override of mtp-train.
#   launch/train_1node.sh model=llama3.1-8b head=mtp data.dir=/data/pc/llama8b out=runs/mtp-llama8b
#   NPROC=4 launch/train_1node.sh head=eagle1 deepspeed=zero1 data.dir=... out=...
# NPROC: processes (GPUs) on this node, default 8. PYTHON: the interpreter, default .venv/bin/python when present.
# Run it from the repository root: relative paths in the config (model.path, data.dir, out) are resolved against
# the working directory. Re-running with the same `out` resumes from its latest checkpoint (resume=auto).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
PY=${PYTHON:-$( [ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || echo python3 )}
NPROC=${NPROC:-8}
# torchrun == python -m torch.distributed.run, from the interpreter that has the package installed.
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m mtp_train.cli.train "$@"
