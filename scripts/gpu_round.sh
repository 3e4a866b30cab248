#!/usr/bin/env bash
# The GPU round of the fast path (issue 3): GPU tests and benchmarks, logs and JSON under $OUT.
#
#   bash scripts/gpu_round.sh tests            # gpu tests (first use JIT-compiles flashinfer: minutes)
#   bash scripts/gpu_round.sh decode           # decode latency vs the bandwidth floor, 0.5B and 1.5B
#   bash scripts/gpu_round.sh throughput 0.5b  # workloads 1 and 2 (1.5b: the same for Qwen2.5-1.5B)
#   bash scripts/gpu_round.sh all              # everything (longer than one 10-minute call)
#
# flashinfer's JIT cache and the random benchmark checkpoints live in the ignored .cache/ folder, so
# later calls on a warm machine reuse them. Each stage's log is $OUT/<stage>.log; $OUT/summary.txt
# lists the commands, exit codes and times. Exits non-zero when any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_logs}
mkdir -p "$OUT"
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/.cache/flashinfer}
export ROLLOUT_BENCH_CACHE=${ROLLOUT_BENCH_CACHE:-$PWD/.cache/bench}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
stage=${1:-all}
size=${2:-0.5b}
status=0

run() {  # run NAME CMD...: CMD's output to $OUT/NAME.log, its tail to the terminal
  local name=$1 t0=$SECONDS rc
  shift
  echo "== $name: ${ROLLOUT_FUSED_OPS:+ROLLOUT_FUSED_OPS=$ROLLOUT_FUSED_OPS }$*" | tee -a "$OUT/summary.txt"
  "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "   exit $rc after $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  tail -n 30 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

{
  date -u
  nvidia-smi
  "$PY" -c "import sys, torch, triton, transformers; print(sys.version); print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  "$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
  "$PY" -c "import torch_memory_saver; print('torch_memory_saver ok')"
  git log -1 --format='commit %H %s' 2>/dev/null
} >"$OUT/env.txt" 2>&1

if [[ $stage == tests || $stage == all ]]; then
  run gpu_tests "$PY" -m pytest -q -rA -s --durations=20 tests/test_gpu_backends.py tests/test_fused_ops.py \
    tests/test_triton_kernels.py
fi
if [[ $stage == decode || $stage == all ]]; then
  for model in qwen2.5-0.5b qwen2.5-1.5b; do
    run "decode_$model" "$PY" scripts/bench_decode.py --model "$model" --json "$OUT/decode_$model.json"
  done
  # the same without the fused Triton elementwise kernels, to show what they buy
  ROLLOUT_FUSED_OPS=0 run decode_qwen2.5-0.5b_unfused "$PY" scripts/bench_decode.py --model qwen2.5-0.5b \
    --json "$OUT/decode_qwen2.5-0.5b_unfused.json"
fi
if [[ $stage == throughput || $stage == all ]]; then
  sizes=$size
  [[ $stage == all ]] && sizes="0.5b 1.5b"
  for s in $sizes; do
    run "throughput_qwen2.5-$s" "$PY" scripts/bench_throughput.py --model "qwen2.5-$s" \
      --json "$OUT/throughput_qwen2.5-$s.json"
  done
fi
exit $status
