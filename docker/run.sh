#!/usr/bin/env bash
# moco-retrieval on one machine with Docker: all its GPUs, or the CPU when it has none.
#
#   docker build -f docker/Dockerfile -t moco-retrieval:latest .
#   docker/run.sh +experiment=queue65k trainer.max_steps=2000
#
# Arguments are Hydra overrides. GPUS: the `docker run --gpus` value (default `all` when
# nvidia-smi lists a GPU, else `none`: no --gpus option, which Docker refuses on a machine
# without the NVIDIA runtime). With GPUs, NPROC_PER_NODE=gpu (the default there) makes the
# entrypoint start torchrun with one process per visible GPU; NPROC_PER_NODE=1 runs a single
# process, and without GPUs one process runs unless NPROC_PER_NODE says otherwise.
# DATA_DIR is mounted at /data (the data cache lives in /data/cache), OUT_DIR at
# /workspace/outputs (run directories, checkpoints, W&B offline runs); both are created here, as
# you, and the container runs as you, so the files are yours.
# DOCKER_RUN_ARGS: more `docker run` options, split on spaces (e.g. "--shm-size 16g").
# W&B: offline unless you export WANDB_MODE=online and WANDB_API_KEY before calling this script.
#
# The command it runs on a GPU machine, spelled out:
#   mkdir -p data outputs
#   docker run --rm --gpus all --ipc=host --user "$(id -u):$(id -g)" \
#     -v "$PWD/data:/data" -v "$PWD/outputs:/workspace/outputs" \
#     -e NPROC_PER_NODE=gpu -e WANDB_MODE=offline moco-retrieval:latest +experiment=queue65k
set -euo pipefail

IMAGE="${IMAGE:-moco-retrieval:latest}"
DATA_DIR="${DATA_DIR:-$PWD/data}"
OUT_DIR="${OUT_DIR:-$PWD/outputs}"
mkdir -p "$DATA_DIR" "$OUT_DIR"

GPUS="${GPUS:-}"
if [[ -z "$GPUS" ]]; then
  GPUS=none
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    GPUS=all
  fi
fi

args=(
  --rm
  --ipc=host # shared memory for DataLoader workers and NCCL
  --user "$(id -u):$(id -g)" # files in OUT_DIR belong to you
  -v "$DATA_DIR:/data"
  -v "$OUT_DIR:/workspace/outputs"
  -e "WANDB_MODE=${WANDB_MODE:-offline}"
)
if [[ "$GPUS" != none ]]; then
  args+=(--gpus "$GPUS" -e "NPROC_PER_NODE=${NPROC_PER_NODE:-gpu}")
elif [[ -n "${NPROC_PER_NODE:-}" ]]; then
  args+=(-e "NPROC_PER_NODE=$NPROC_PER_NODE")
fi
if [[ -n "${WANDB_API_KEY:-}" ]]; then
  args+=(-e WANDB_API_KEY) # the value comes from this shell's environment, not the command line
fi
if [[ -n "${MOCO_RETRIEVAL_JOB_ID:-}" ]]; then
  args+=(-e MOCO_RETRIEVAL_JOB_ID) # run directory outputs/<id>; rerun with the same id to resume
fi
read -r -a more <<<"${DOCKER_RUN_ARGS:-}"
args+=("${more[@]}")

exec docker run "${args[@]}" "$IMAGE" "$@"
