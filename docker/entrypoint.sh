#!/usr/bin/env bash
# moco-retrieval container entrypoint: turns the cluster's environment into a launch.
#
#   docker run ... moco-retrieval:latest +experiment=queue65k trainer.max_steps=1000
#
# Every argument is passed through, unchanged and in order, as a Hydra override of
# `python -m $ENTRY` (default moco_retrieval.train). If the first argument is a command on PATH
# and not an override (e.g. `bash`, `wandb sync ...`), that command runs instead.
#
# Launch modes (LAUNCHER=auto|slurm|torchrun|single, default auto, detected in this order):
#   worker    LOCAL_RANK or TORCHELASTIC_RUN_ID set: already a torchrun worker -> python -m ENTRY
#   slurm     srun started one task per GPU (SLURM_JOB_ID, SLURM_NTASKS, SLURM_PROCID set, job not
#             named bash/interactive) -> python -m ENTRY; Lightning's SLURMEnvironment does the
#             rest. Adds trainer.devices=<tasks per node> trainer.num_nodes=<nodes>.
#   torchrun  MASTER_ADDR, MASTER_PORT and WORLD_SIZE set -> torchrun --nnodes --node_rank
#             --nproc_per_node --master_addr --master_port -m ENTRY; adds trainer.devices and
#             trainer.num_nodes to match. NPROC_PER_NODE alone (no MASTER_ADDR): one node,
#             master 127.0.0.1:${MASTER_PORT:-29500}.
#               nproc_per_node: NPROC_PER_NODE, else PET_NPROC_PER_NODE, else the GPUs that
#                               nvidia-smi lists, else 1 ("auto"/"gpu" also mean the GPU count)
#               node rank:      NODE_RANK, else PET_NODE_RANK, else RANK (a Kubeflow PyTorchJob
#                               sets RANK to the pod's index, i.e. the node rank)
#               nodes:          NNODES, else PET_NNODES, else
#                               - with NODE_RANK set (plain torchrun convention): WORLD_SIZE is
#                                 the number of processes, nodes = WORLD_SIZE / nproc_per_node;
#                               - without NODE_RANK (PyTorchJob): WORLD_SIZE counts the pods.
#   single    otherwise -> python -m ENTRY (one process).
#
# Also, unless the arguments already set them:
#   trainer.accelerator=$ACCELERATOR when ACCELERATOR is set (the default trainer preset
#     picks the GPU by itself);
#   hydra.run.dir=$OUTPUT_ROOT/<job id> (OUTPUT_ROOT default: outputs) when there is a job id
#     (MOCO_RETRIEVAL_JOB_ID, SLURM_JOB_ID, PYTORCHJOB_NAME, K8S_JOB_NAME), so that every rank
#     and every requeued run of one job uses one run directory. RUN_DIR_FROM_JOB=0 turns it off.
#   hydra.run.dir=<run_dir> when the arguments set run_dir: Hydra's own folder (its .hydra record)
#     is then the run directory, not a new outputs/<date>/<time> beside it.
# Other knobs: ENTRY (module), PYTHON (default python), TORCHRUN (default torchrun),
#   TORCHRUN_ARGS (extra torchrun options, split on spaces), DRY_RUN=1 (print, do not run).
set -euo pipefail

log() { printf '[moco-retrieval] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

ENTRY="${ENTRY:-moco_retrieval.train}"
PYTHON="${PYTHON:-python}"
TORCHRUN="${TORCHRUN:-torchrun}"
LAUNCHER="${LAUNCHER:-auto}"

# A command instead of overrides: `docker run IMAGE bash`, `docker run IMAGE wandb sync DIR`.
if [[ $# -gt 0 && "$1" != *=* && "$1" != [-+~]* ]] && command -v -- "$1" >/dev/null 2>&1; then
  log "exec: $*"
  exec "$@"
fi

is_int() { [[ "${1:-}" =~ ^[0-9]+$ ]]; }
is_pos() { [[ "${1:-}" =~ ^0*[1-9][0-9]*$ ]]; }

# True when the user's overrides already set KEY (KEY=..., +KEY=..., ++KEY=..., ~KEY).
has_override() {
  local key="$1" arg
  shift
  for arg in "$@"; do
    arg="${arg#++}"
    arg="${arg#+}"
    arg="${arg#\~}"
    if [[ "$arg" == "$key" || "$arg" == "$key="* ]]; then
      return 0
    fi
  done
  return 1
}

# The value of the last KEY=..., +KEY=... or ++KEY=... among the arguments (nothing when none).
override_value() {
  local key="$1" arg value=""
  shift
  for arg in "$@"; do
    arg="${arg#++}"
    arg="${arg#+}"
    if [[ "$arg" == "$key="* ]]; then
      value="${arg#"$key="}"
    fi
  done
  printf '%s' "$value"
}

gpu_count() {
  local n=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
  fi
  is_int "$n" || n=0
  printf '%s\n' "$n"
}

job_id() {
  local v
  for v in MOCO_RETRIEVAL_JOB_ID SLURM_JOB_ID PYTORCHJOB_NAME K8S_JOB_NAME; do
    if [[ -n "${!v:-}" ]]; then
      if [[ "$v" == SLURM_JOB_ID && -n "${SLURM_ARRAY_JOB_ID:-}" && -n "${SLURM_ARRAY_TASK_ID:-}" ]]; then
        printf '%s_%s\n' "$SLURM_ARRAY_JOB_ID" "$SLURM_ARRAY_TASK_ID"
      else
        printf '%s\n' "${!v}"
      fi
      return 0
    fi
  done
  return 0
}

if [[ "$LAUNCHER" == auto ]]; then
  if [[ -n "${LOCAL_RANK:-}" || -n "${TORCHELASTIC_RUN_ID:-}" ]]; then
    LAUNCHER=worker
  elif [[ -n "${SLURM_JOB_ID:-}" && -n "${SLURM_NTASKS:-}" && -n "${SLURM_PROCID:-}" &&
          "${SLURM_JOB_NAME:-}" != bash && "${SLURM_JOB_NAME:-}" != interactive ]]; then
    LAUNCHER=slurm
  elif [[ -n "${MASTER_ADDR:-}" && -n "${MASTER_PORT:-}" && -n "${WORLD_SIZE:-}" ]]; then
    LAUNCHER=torchrun
  elif [[ -n "${NPROC_PER_NODE:-}" ]]; then
    LAUNCHER=torchrun # one node, several processes: docker run --gpus all -e NPROC_PER_NODE=gpu
  else
    LAUNCHER=single
  fi
fi

extra=()
devices=""
nodes=""
case "$LAUNCHER" in
  slurm)
    nodes="${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}"
    is_pos "$nodes" || die "cannot read the node count (SLURM_NNODES=${SLURM_NNODES:-})"
    devices="${SLURM_NTASKS_PER_NODE:-}"
    devices="${devices%%(*}"
    if [[ -z "$devices" ]]; then
      is_int "${SLURM_NTASKS:-}" || die "SLURM_NTASKS is not a number: ${SLURM_NTASKS:-}"
      ((SLURM_NTASKS % nodes == 0)) || die "SLURM_NTASKS=$SLURM_NTASKS is not a multiple of $nodes nodes; use --ntasks-per-node"
      devices=$((SLURM_NTASKS / nodes))
    fi
    is_pos "$devices" || die "cannot read the tasks per node (SLURM_NTASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-})"
    ;;
  torchrun)
    nproc="${NPROC_PER_NODE:-${PET_NPROC_PER_NODE:-}}"
    if [[ -z "$nproc" || "$nproc" == auto || "$nproc" == gpu ]]; then
      nproc="$(gpu_count)"
      ((nproc > 0)) || nproc=1
    fi
    is_pos "$nproc" || die "nproc_per_node must be a positive number, auto or gpu, got '$nproc'"
    if [[ -z "${MASTER_ADDR:-}" ]]; then
      # one node, no rendezvous given: this machine is the master
      MASTER_ADDR=127.0.0.1
      MASTER_PORT="${MASTER_PORT:-29500}"
      nodes=1
      node_rank=0
    else
      : "${MASTER_PORT:?a torchrun launch with MASTER_ADDR needs MASTER_PORT}"
      node_rank="${NODE_RANK:-${PET_NODE_RANK:-${RANK:-0}}}"
      is_int "$node_rank" || die "node rank must be a number, got '$node_rank'"
      nodes="${NNODES:-${PET_NNODES:-}}"
      if [[ -z "$nodes" ]]; then
        is_int "${WORLD_SIZE:-}" || die "WORLD_SIZE must be a number, got '${WORLD_SIZE:-}'"
        if [[ -n "${NODE_RANK:-}" ]]; then
          ((WORLD_SIZE % nproc == 0)) || die "WORLD_SIZE=$WORLD_SIZE (processes) is not a multiple of nproc_per_node=$nproc; set NNODES"
          nodes=$((WORLD_SIZE / nproc))
        else
          nodes="$WORLD_SIZE"
        fi
      fi
      is_pos "$nodes" || die "the node count must be a fixed positive number (elastic ranges are not supported), got '$nodes'"
      ((node_rank < nodes)) || die "node rank $node_rank is not below the node count $nodes"
    fi
    devices="$nproc"
    ;;
  worker | single) ;;
  *) die "LAUNCHER must be auto, slurm, torchrun or single, got '$LAUNCHER'" ;;
esac

if [[ -n "$devices" ]]; then
  has_override trainer.devices "$@" || extra+=("trainer.devices=$devices")
  has_override trainer.num_nodes "$@" || extra+=("trainer.num_nodes=$nodes")
fi
if [[ -n "${ACCELERATOR:-}" ]] && ! has_override trainer.accelerator "$@"; then
  extra+=("trainer.accelerator=$ACCELERATOR")
fi
jid="$(job_id)"
if [[ -n "$jid" && "${RUN_DIR_FROM_JOB:-1}" != 0 ]] && ! has_override hydra.run.dir "$@" && ! has_override run_dir "$@"; then
  extra+=("hydra.run.dir=${OUTPUT_ROOT:-outputs}/$jid")
fi
run_dir="$(override_value run_dir "$@")"
if [[ -n "$run_dir" && "$run_dir" != null ]] && ! has_override hydra.run.dir "$@"; then
  extra+=("hydra.run.dir=$run_dir")
fi

case "$LAUNCHER" in
  torchrun)
    read -r -a torchrun_extra <<<"${TORCHRUN_ARGS:-}"
    cmd=("$TORCHRUN" "--nnodes=$nodes" "--node_rank=$node_rank" "--nproc_per_node=$nproc"
         "--master_addr=$MASTER_ADDR" "--master_port=$MASTER_PORT" "${torchrun_extra[@]}"
         -m "$ENTRY" "${extra[@]}" "$@")
    ;;
  *)
    cmd=("$PYTHON" -m "$ENTRY" "${extra[@]}" "$@")
    ;;
esac

log "launcher=$LAUNCHER job=${jid:-none}: $(printf '%q ' "${cmd[@]}")"
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  exit 0
fi
exec "${cmd[@]}"
