#!/usr/bin/env bash
# moco-retrieval on one machine with Docker, all its GPUs.
#
#   docker build -f docker/Dockerfile -t moco-retrieval:latest .
#   docker/run.sh +experiment=queue65k trainer.max_steps=2000
#
# Arguments are Hydra overrides. With NPROC_PER_NODE=gpu (the default here) the entrypoint starts
# torchrun with one process per visible GPU; NPROC_PER_NODE=1 runs a single process.
# DATA_DIR is mounted at /data (the data cache lives in /data/cache), OUT_DIR at
# /workspace/outputs (run directories, checkpoints, W&B offline runs).
# W&B: offline unless you export WANDB_MODE=online and WANDB_API_KEY before calling this script.
#
# The command it runs, spelled out:
#   docker run --rm --gpus all --ipc=host -v "$PWD/data:/data" -v "$PWD/outputs:/workspace/outputs" \
#     -e NPROC_PER_NODE=gpu -e WANDB_MODE -e WANDB_API_KEY moco-retrieval:latest +experiment=queue65k
set -euo pipefail

IMAGE="${IMAGE:-moco-retrieval:latest}"
DATA_DIR="${DATA_DIR:-$PWD/data}"
OUT_DIR="${OUT_DIR:-$PWD/outputs}"
mkdir -p "$DATA_DIR" "$OUT_DIR"

args=(
  --rm --gpus all
  --ipc=host # shared memory for DataLoader workers and NCCL
  --user "$(id -u):$(id -g)" # files in OUT_DIR belong to you
  -v "$DATA_DIR:/data"
  -v "$OUT_DIR:/workspace/outputs"
  -e "NPROC_PER_NODE=${NPROC_PER_NODE:-gpu}"
  -e "WANDB_MODE=${WANDB_MODE:-offline}"
)
if [[ -n "${WANDB_API_KEY:-}" ]]; then
  args+=(-e WANDB_API_KEY) # the value comes from this shell's environment, not the command line
fi
if [[ -n "${MOCO_RETRIEVAL_JOB_ID:-}" ]]; then
  args+=(-e MOCO_RETRIEVAL_JOB_ID) # run directory outputs/<id>; rerun with the same id to resume
fi

exec docker run "${args[@]}" "$IMAGE" "$@"
