#!/usr/bin/env bash
# One GPU round: every gpu-marked test, then the decode-step and weight-sync benchmarks of this tree
# and of a baseline tree (default .baseline/, e.g. `git archive <commit> rollout scripts integrations | tar -x -C
# .baseline`) in the same run. Logs under $OUT (default gpu_logs/); exits non-zero if a stage failed.
# STAGES picks among: tests bench serve fidelity hybrid moe (default "tests bench"). serve: the step
# driver's delivery cost, bench_worker's streamed / Engine.generate and bench_serve's process and thread
# ratios, 3 runs each. fidelity: check_fidelity at the Qwen3.5-2B/9B and Qwen3-30B-A3B shapes (4 layers).
# hybrid: the Qwen3.5 decode step and GRPO-shaped throughput. moe: scripts/bench_moe.py (48 layers).
# LIMIT (seconds, default 900) bounds each stage, so that a hung stage leaves time for the rest.
# bench alternates the trees REPEATS times (default 2): one run each swung by a millisecond a step on
# an H100 (2026-12-08). serve needs fastapi, uvicorn and httpx, which the device image lacks: carry
# them as wheels (`bash ../shared/device/wheels.sh .whl fastapi uvicorn httpx starlette h11 httpcore
# anyio sniffio click idna certifi pydantic pydantic-core annotated-types typing-inspection
# typing-extensions`: 3.7 MB more).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_logs}
BASE=${BASE:-$PWD/.baseline}
mkdir -p "$OUT"
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/.cache/flashinfer}
export ROLLOUT_BENCH_CACHE=${ROLLOUT_BENCH_CACHE:-$PWD/.cache/bench}
export PYTHONUNBUFFERED=1
status=0
run() {  # run NAME DIR CMD...: CMD in DIR with DIR on PYTHONPATH, output to $OUT/NAME.log
  local name=$1 dir=$2 t0=$SECONDS rc
  shift 2
  echo "== $name ($dir): $*" | tee -a "$OUT/summary.txt"
  (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} timeout -k 10 "${LIMIT:-900}" "$@") >"$OUT/$name.log" 2>&1
  rc=$?
  echo "   exit $rc after $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  tail -n ${TAIL:-15} "$OUT/$name.log"
  [ "$rc" -eq 0 ] || status=1
}
stages=${STAGES:-tests bench}
if [[ $stages == *tests* ]]; then
  run gpu_tests "$PWD" python3 -m pytest -v -rfE -m gpu --durations=15 ${TESTS:-tests}
fi
if [[ $stages == *bench* ]]; then
  for rep in $(seq "${REPEATS:-2}"); do
    for tree in "$PWD" "$BASE"; do
      tag=$([[ $tree == "$PWD" ]] && echo head || echo base)_$rep
      # this tree's script for both trees: the same warm-up and floor (it imports either layout)
      run "decode_$tag" "$tree" python3 "$PWD/scripts/bench_decode.py" --model qwen2.5-0.5b \
        --batch-sizes 1 64 256 --reps 30 --json "$OUT/decode_$tag.json"
    done
  done
  for tree in "$PWD" "$BASE"; do
    tag=$([[ $tree == "$PWD" ]] && echo head || echo base)
    run "sync_$tag" "$tree" python3 scripts/bench_weight_sync.py --models qwen2.5-0.5b --buckets-mb 128 \
      --no-nccl
  done
fi
if [[ $stages == *serve* ]]; then
  for i in 1 2 3; do
    run "worker_$i" "$PWD" python3 scripts/bench_worker.py --model qwen2.5-0.5b
    run "serve_$i" "$PWD" python3 scripts/bench_serve.py --model qwen2.5-0.5b --requests 256 --clients 256 \
      --mode both --client-procs 8 --client-cores 8 --json "$OUT/serve_$i.json"
  done
  grep -h "streamed / Engine.generate" "$OUT"/worker_*.log | tee -a "$OUT/summary.txt"
  grep -h '_ratio"' "$OUT"/serve_*.json | tee -a "$OUT/summary.txt"
fi
if [[ $stages == *fidelity* ]]; then
  for shape in ${FIDELITY_SHAPES:-qwen3.5-2b qwen3.5-9b qwen3-30b-a3b}; do
    run "fidelity_$shape" "$PWD" python3 scripts/check_fidelity.py --random-shape "$shape" --layers 4 \
      --dtype bfloat16 --out "$PWD/.cache/fidelity/$shape"
  done
fi
if [[ $stages == *hybrid* ]]; then
  for model in ${HYBRID_MODELS:-qwen3.5-2b qwen3.5-9b}; do
    run "decode_$model" "$PWD" python3 scripts/bench_decode.py --model "$model" --batch-sizes 1 64 256 \
      --context 1024 --reps 20 --json "$OUT/decode_$model.json"
    run "hybrid_$model" "$PWD" python3 scripts/bench_hybrid.py --model "$model" --json "$OUT/hybrid_$model.json"
  done
fi
if [[ $stages == *moe* ]]; then
  run moe "$PWD" python3 scripts/bench_moe.py ${MOE_ARGS:-}
fi
exit $status
