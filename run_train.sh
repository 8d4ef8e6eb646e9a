#!/usr/bin/env bash
# NGPU=2 CONFIG_FILE=./train_configs/llama_debug.toml ./run_train.sh [--section.key value ...]
# NGPU counts processes per node (each on the CPU over gloo where there is no accelerator).
# Several nodes: NNODES=2 NODE_RANK=0|1 RDZV_ENDPOINT=host:29500 ./run_train.sh ... on each node.
# Relative paths (CONFIG_FILE, --job.dump_folder, ...) mean the directory you run it from.
set -eu
# A checkpoint signal before the launcher runs (it blocks them as its first statement): nothing started yet.
_stopped() {
  echo "$1: stopped before training started, nothing new to save; run the same command again to resume"
  exit 0
}
trap '_stopped SIGTERM' TERM
trap '_stopped SIGUSR1' USR1
trap '_stopped SIGINT' INT
source "$(dirname "${BASH_SOURCE[0]}")/scripts/python_env.sh"  # sets REPO; use_python

usage() {
  cat <<EOF
usage: [NGPU=N] [CONFIG_FILE=FILE] ./run_train.sh [--section.key VALUE ...]
  NGPU         processes on this node (default 1); each uses the CPU over gloo where there is no accelerator
  CONFIG_FILE  the TOML config (default: train_configs/llama_debug.toml in this repository)
  NNODES, NODE_RANK, RDZV_ENDPOINT=host:port   several nodes: run the same command on each
  PYTHON       the interpreter (default: .venv here, else python on PATH with torch; else .venv is set up)
  TORCHTITAN_RNG_TORCH   the torch that setting up .venv installs (default torch==2.13.0; torch>=2.11 with a GPU)
Relative paths mean the directory you run it from. Every --section.key: python -m torchtitan_rng.train --help
EOF
}

for arg in "$@"; do
  case $arg in -h | --help) usage; exit 0 ;; esac
done
NGPU=${NGPU:-1}
NNODES=${NNODES:-1}
[[ $NGPU =~ ^[1-9][0-9]*$ ]] || _fail "NGPU=$NGPU is not a process count; set NGPU to a whole number >= 1 (e.g. NGPU=2)"
[[ $NNODES =~ ^[1-9][0-9]*$ ]] || _fail "NNODES=$NNODES is not a node count; set NNODES to a whole number >= 1"
CONFIG_FILE=${CONFIG_FILE:-$REPO/train_configs/llama_debug.toml}
use_python torch torchdata numpy
# The package from this checkout, whichever interpreter runs it; the run stays in the caller's directory.
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
# One intra-op thread per process unless told otherwise (torchrun would pick 1 and print a banner).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}

if [ "$NNODES" -gt 1 ]; then
  [ -n "${NODE_RANK:-}" ] || _fail "NNODES=$NNODES needs NODE_RANK, this node's number from 0 to $((NNODES - 1))"
  [ -n "${RDZV_ENDPOINT:-}" ] || _fail "NNODES=$NNODES needs RDZV_ENDPOINT=host:port of node 0"
  rdzv=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT")
else
  rdzv=(--standalone --nnodes 1)
fi
# torchrun, run by the launcher: bad input fails there in one line before any rank starts; it holds the
# dump folder's lock; a checkpoint signal (SIGTERM, SIGUSR1) makes every rank save and the job exit 0.
exec "$PYTHON" -m torchtitan_rng.launch.launcher "${rdzv[@]}" --nproc-per-node "$NGPU" --local-ranks-filter 0 \
  --role rank --tee 3 --module torchtitan_rng.train --job.config_file "$CONFIG_FILE" "$@"
