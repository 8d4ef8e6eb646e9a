#!/usr/bin/env bash
# NGPU=2 CONFIG_FILE=./train_configs/llama_debug.toml ./run_train.sh [--section.key value ...]
# NGPU counts processes per node (each on the CPU over gloo where there is no accelerator).
# Several nodes: NNODES=2 NODE_RANK=0|1 RDZV_ENDPOINT=host:29500 ./run_train.sh ... on each node.
set -eu
NGPU=${NGPU:-1}
NNODES=${NNODES:-1}
CONFIG_FILE=${CONFIG_FILE:-./train_configs/llama_debug.toml}
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python}
# One intra-op thread per process unless told otherwise (torchrun would pick 1 and print a banner).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}

if [ "$NNODES" -gt 1 ]; then
  rdzv=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}" --rdzv-backend c10d
        --rdzv-endpoint "${RDZV_ENDPOINT:?set RDZV_ENDPOINT to host:port of node 0}")
else
  rdzv=(--standalone --nnodes 1)
fi
# torchrun, run by the launcher: bad input fails there in one line before any rank starts; it holds the
# dump folder's lock; a checkpoint signal (SIGTERM, SIGUSR1) makes every rank save and the job exit 0.
exec "$PYTHON" -m torchtitan_rng.launch.launcher "${rdzv[@]}" --nproc-per-node "$NGPU" --local-ranks-filter 0 \
  --role rank --tee 3 --module torchtitan_rng.train --job.config_file "$CONFIG_FILE" "$@"
