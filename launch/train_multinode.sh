#!/usr/bin/env bash
# mtp-train over several nodes with torchrun; run this same command on every node. Arguments are Hydra overrides.
#
# Static ranks (each node names its rank; MASTER_ADDR is node 0):
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 launch/train_multinode.sh model=llama3.1-8b \
#       data.dir=/shared/pc out=/shared/runs/mtp        # then NODE_RANK=1, 2, 3 on the other nodes
# Rendezvous (c10d; nodes get their ranks on arrival, any node may host the endpoint):
#   NNODES=4 MASTER_ADDR=node0 MASTER_PORT=29500 RDZV_ID=mtp-llama8b launch/train_multinode.sh ...
#
# NPROC_PER_NODE: processes (GPUs) per node, default 8. PYTHON: the interpreter, default .venv/bin/python.
# `out` and `data.dir` must be on a filesystem every node sees: each rank writes its ZeRO partition into the
# checkpoint and reads it back on resume. Re-running with the same `out` resumes (resume=auto).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
PY=${PYTHON:-$( [ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || echo python3 )}
: "${NNODES:?set NNODES to the number of nodes}"
: "${MASTER_ADDR:?set MASTER_ADDR to the host name of node 0 (or of the rendezvous host)}"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
if [ -n "${NODE_RANK:-}" ]; then
  dist=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
else
  dist=(--nnodes "$NNODES" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"
        --rdzv_id "${RDZV_ID:-mtp-train}")
fi
exec "$PY" -m torch.distributed.run "${dist[@]}" --nproc_per_node "$NPROC_PER_NODE" -m mtp_train.cli.train "$@"
