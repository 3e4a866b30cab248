#!/usr/bin/env bash
# The benchmark half of a GPU round: the GRPO loop at a real batch (0.5B shape, 64 x 8 x 1024),
# check_fidelity on the 0.5B shape for every backend, the server under 256 streaming clients, and
# weight sync. Each stage's log goes to $OUT/<stage>.log; a stage past its time limit is cut.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_logs}
mkdir -p "$OUT"
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/.cache/flashinfer}
export ROLLOUT_BENCH_CACHE=${ROLLOUT_BENCH_CACHE:-$PWD/.cache/bench}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0))s: $*" | tee -a "$OUT/summary.txt"
  tail -n ${TAIL:-12} "$OUT/$name.log"
}
M=$(python3 scripts/models.py qwen2.5-0.5b)
stage grpo "${GRPO_S:-230}" python3 examples/grpo.py --model "$M" --batch 64 --n 8 --max-new-tokens 1024 \
  --micro-batch-tokens 16384 --gradient-checkpointing --autocast bf16 --lr 1e-6 --steps "${GRPO_STEPS:-4}" \
  --no-progress
stage fidelity 120 python3 scripts/check_fidelity.py --model "$M"
stage serve 120 python3 scripts/bench_serve.py --model qwen2.5-0.5b --requests 256 --clients 256 \
  --json "$OUT/serve.json"
stage sync 60 python3 scripts/bench_weight_sync.py --models qwen2.5-0.5b --buckets-mb 128 --no-nccl --repeat 5
