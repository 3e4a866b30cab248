#!/usr/bin/env bash
# Every row of issue 15's table for one model shape, in one GPU run:
#   decode     whole decode step at batch 1, 64, 256 against the bandwidth floor (bench_decode, with a
#              kernel profile) and the engine's own step loop with the overlap schedule (bench_host_step)
#   grpo       the GRPO-shaped workload against its decode floor (bench_throughput --workload 2)
#   sync       in-process update, sync_weights and EngineProcess by CUDA IPC against the copy floor
#   memory     release / resume of every tag against torch_memory_saver's own pause / resume
#   start      engine start-up by phase
#   rl_step    the colocated GRPO step's breakdown (bench_rl_step; needs the trainer to fit beside it)
#
#   bash scripts/bench_round15.sh qwen2.5-0.5b                  # every part; logs under $OUT/<shape>/
#   PARTS="sync memory" bash scripts/bench_round15.sh qwen2.5-7b
# Each part's log is $OUT/<shape>/<part>.log; summary.txt lists exit codes and seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
M=${1:?usage: bench_round15.sh SHAPE}
PARTS=${PARTS:-decode grpo sync memory start rl_step}
LOG=${OUT:-$PWD/gpu_logs}/$M
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" "$@" >"$LOG/$name.log" 2>&1
  echo "== $M $name: exit $? after $((SECONDS - t0))s: $*" | tee -a "$LOG/summary.txt"
  tail -n "${TAIL:-8}" "$LOG/$name.log"
}
python3 scripts/models.py "$M" >/dev/null  # the random checkpoint, made once
for part in $PARTS; do
  case $part in
    decode)
      stage decode 240 python3 scripts/bench_decode.py --model "$M" --batch-sizes 1 64 256 --reps 30 --profile \
        --json "$LOG/decode.json"
      stage host_step 120 python3 scripts/bench_host_step.py --device cuda --model "$M" --batch-sizes 1 64 256 \
        --overlap on ;;
    grpo)
      stage grpo 240 python3 scripts/bench_throughput.py --model "$M" --workload 2 --w2 64 8 512 512 \
        --json "$LOG/grpo.json" ;;
    sync)
      stage sync 240 python3 scripts/bench_weight_sync.py --models "$M" --buckets-mb 128,512 --no-nccl --repeat 5 \
        --profile ;;
    memory)
      stage memory 240 python3 scripts/bench_memory.py --model "$M" --repeats 3 ;;
    start)
      stage start 180 python3 scripts/bench_start.py --model "$M" --starts 3 ;;
    rl_step)
      stage rl_step 300 python3 scripts/bench_rl_step.py --model "$M" --batch 64 --n 8 --max-new-tokens 1024 \
        --micro-batch-tokens 16384 --gradient-checkpointing --autocast bf16 --lr 1e-6 --steps 3 --profile ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
