"""Engine start-up time by phase: config, model construction, weight loading, tokenizer, KV pool, runner
(scheduler, attention backend) and CUDA-graph capture (GPU only), from `Engine.start_seconds`.

    python scripts/bench_start.py --model qwen2.5-0.5b [--device cpu] [--starts 3]

The first start in a process also pays imports, the CUDA context and a cold page cache; later starts
show the warm cost (the file in the page cache, flashinfer's JIT cache warm). ROLLOUT_LOAD_THREADS=1
loads the checkpoint on one thread, for comparison.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import SHAPES, bench_model  # noqa: E402

from rollout import Engine  # noqa: E402
from rollout.weights.loader import LOAD_THREADS  # noqa: E402

PHASES = ("config", "model", "weights", "tokenizer", "kv_cache", "runner", "cuda_graphs")


def start_once(folder: str, device: str, dtype: str, max_total_tokens: int | None) -> dict[str, float]:
    t0 = time.perf_counter()
    engine = Engine(folder, device=device, dtype=dtype, max_total_tokens=max_total_tokens)
    phases = {p: engine.start_seconds.get(p, 0.0) for p in PHASES}
    phases["total"] = time.perf_counter() - t0
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b", help=f"a checkpoint folder or one of {sorted(SHAPES)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size (default: the engine's)")
    args = ap.parse_args()
    folder = str(bench_model(args.model)) if args.model in SHAPES else args.model
    print(f"engine start: {Path(folder).name} on {args.device}, {args.dtype}, {LOAD_THREADS} load threads\n")
    print("| start | " + " | ".join(f"{p} s" for p in (*PHASES, "total")) + " |")
    print("|---" * (len(PHASES) + 2) + "|")
    for i in range(args.starts):
        phases = start_once(folder, args.device, args.dtype, args.max_total_tokens)
        print(f"| {i} | " + " | ".join(f"{phases[p]:.3f}" for p in (*PHASES, "total")) + " |", flush=True)


if __name__ == "__main__":
    main()
