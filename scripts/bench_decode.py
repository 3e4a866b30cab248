"""Decode step latency against the memory-bandwidth floor, with and without CUDA graphs.

B sequences each hold a `--context`-token KV cache (pages allocated; the values do not matter for
speed) and decode one token per step. For each batch size:

  forward  model forward + logits for one step (wall time, synchronised; host launch cost included)
  step     one step as the runner runs it: prepare, forward, sampling, one copy to the host
           (synchronised: host and device time add up)
  engine   a decode step of the engine's own loop (`Engine.step` with its overlap schedule, the host
           work of step k+1 under the device work of step k): B requests of `--context` prompt tokens,
           sampling at temperature 1 with logprobs, timed once all of them decode
  floor    (weight bytes + KV bytes read) / copy bandwidth, the bandwidth measured in this run by a
           large device-to-device copy (bytes read + written per second)

plus the CUDA-graph capture time and memory.

    python scripts/bench_decode.py --model qwen2.5-0.5b --batch-sizes 1 64 256 --context 1024
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import SHAPES, bench_model  # noqa: E402

from rollout import Engine, SamplingParams  # noqa: E402

try:  # the fallback lets this script time a tree from before the house plan (gpu_check.sh's baseline)
    from rollout.state.scheduled import ScheduledBatch
    from rollout.state.sequence import Sequence, Status
except ImportError:
    from rollout.scheduler import ScheduledBatch
    from rollout.sequence import Sequence, Status


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Bytes moved per second (read + write) by a large device-to-device copy."""
    if device.type != "cuda":  # a dry run of the script on a CPU
        nbytes, reps = 64 << 20, 3
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), reps)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (a tied embedding is read once, as the LM head)."""
    return sum(
        p.numel() * p.element_size() for p in model.parameters()
    )  # parameters() yields a tied one once


def kv_bytes(engine: Engine, batch: int, tokens: int) -> int:
    kv = engine.kv
    return batch * tokens * kv.num_layers * 2 * kv.num_kv_heads * kv.head_dim * kv.dtype.itemsize


def state_bytes(engine: Engine, batch: int) -> int:
    """Per-request state a decode step reads and writes (linear-attention models; 0 for the others)."""
    state = getattr(engine, "state", None)
    return 0 if state is None else 2 * batch * state.bytes_per_slot(state.shapes)


def decode_batch(engine: Engine, batch: int, context: int, seed: int) -> ScheduledBatch:
    """`batch` running sequences with `context` tokens cached and one new token to decode."""
    rng = np.random.default_rng(seed)
    vocab, S = engine.model_config.vocab_size, engine.kv.page_size
    params = SamplingParams(temperature=1.0, max_new_tokens=1 << 20, ignore_eos=True)
    seqs = []
    for i in range(batch):
        tokens = rng.integers(0, vocab, context + 1).tolist()
        seq = Sequence(1_000_000 + seed * 10_000 + i, i, 0, tokens, len(tokens), params, seed + i)
        seq.pages = engine.pages.allocate(-(-(context + 1) // S))
        if seq.pages is None:
            raise ValueError("the KV pool is too small for this batch; lower --context or batch sizes")
        seq.num_computed, seq.status = context, Status.RUNNING
        seqs.append(seq)
    return ScheduledBatch(seqs, [1] * batch, decode=True)


def release(engine: Engine, batch: ScheduledBatch) -> None:
    """Give a made-up batch's pages back; its sequences are done (their state slots, if any, too)."""
    for seq in batch.seqs:
        engine.pages.release(seq.pages)
        seq.pages, seq.status = [], Status.FINISHED


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    """Seconds per call, synchronised, after a warm-up."""
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def engine_step(engine: Engine, batch: int, context: int, reps: int, seed: int) -> float:
    """Seconds per decode step of `Engine.step` for `batch` requests with `context`-token prompts."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=1.0, max_new_tokens=reps + 64, ignore_eos=True, logprobs=True)
    rids = [f"engine-{seed}-{i}" for i in range(batch)]
    for rid in rids:
        engine.add_request(rid, rng.integers(0, vocab, context).tolist(), params)
    # until three steps in a row decode the whole batch: every prompt computed (with mixed steps, early
    # requests decode for many steps while later prompts are still being prefilled)
    whole, steps = 0, 0
    while whole < 3:
        steps += 1
        if steps > 10_000:
            raise RuntimeError(f"batch {batch} never decoded whole: is the KV pool too small for it?")
        before = engine.stats.decode_tokens
        engine.step()
        whole = whole + 1 if engine.stats.decode_tokens - before == batch else 0
    sync()
    t0 = time.perf_counter()
    before = engine.stats.decode_tokens
    for _ in range(reps):
        engine.step()
    sync()
    seconds = time.perf_counter() - t0
    if engine.stats.decode_tokens - before != reps * batch:
        raise RuntimeError("a timed step was not a whole decode step of the batch")
    for rid in rids:
        engine.abort_request(rid)
    engine.flush_cache()  # the prompts' pages: the next batch size needs them
    return seconds / reps


def profile_steps(runner, batch: ScheduledBatch, steps: int = 10) -> None:
    """Where a whole step's device time goes: the top kernels over a few steps."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.step(batch)
        sync()
    print(f"-- profile of {steps} steps at batch {len(batch.seqs)}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b", help=f"a checkpoint folder or one of {sorted(SHAPES)}")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of graph-replayed steps")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (numbers meaningless)")
    args = ap.parse_args()
    device = torch.device(args.device)
    folder = bench_model(args.model) if args.model in SHAPES else Path(args.model)
    bandwidth = copy_bandwidth(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the copy buffers
    max_bs = max(args.batch_sizes)
    pages_per_seq = -(-(args.context + 1) // 16)
    engine = Engine(
        str(folder),
        device=args.device,
        attention_backend=args.backend,
        max_running_requests=max_bs,
        # the pages of the runner's batches, or (one at a time) the engine loop's growing requests
        max_total_tokens=(pages_per_seq * 16 + args.reps + 128) * sum(args.batch_sizes) + 4096,
    )
    graphs = engine.runner.graphs
    weights = weight_bytes(engine.model)
    info = {
        "model": args.model,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": engine.backend_name,
        "torch": torch.__version__,
        "copy_bandwidth_TBps": bandwidth / 1e12,
        "weight_GB": weights / 1e9,
        "context": args.context,
        "graph_capture_s": graphs.capture_seconds if graphs else None,
        "graph_memory_MiB": graphs.memory_bytes / 2**20 if graphs else None,
        "graph_sizes": len(graphs.graphs) if graphs else 0,
        "date": time.strftime("%Y-%m-%d"),
        "rows": [],
    }
    print(
        f"{info['gpu']}, {args.model} ({weights / 1e9:.2f} GB of weights), backend {engine.backend_name}, "
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, context {args.context}"
    )
    if graphs:
        print(
            f"graph capture: {len(graphs.graphs)} sizes in {graphs.capture_seconds:.2f}s, "
            f"{graphs.memory_bytes / 2**20:.0f} MiB"
        )
    head = (
        "batch",
        "graphs",
        "floor ms",
        "forward ms",
        "x floor",
        "step ms",
        "x floor",
        "engine ms",
        "x floor",
    )
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (5, 6, 9, 10, 7, 8, 7, 9, 7))))
    runner = engine.runner
    for i, bs in enumerate(args.batch_sizes):
        batch = decode_batch(engine, bs, args.context, seed=i)
        floor = (weights + kv_bytes(engine, bs, args.context + 1) + state_bytes(engine, bs)) / bandwidth
        for use_graphs in [True, False] if graphs else [False]:
            runner.graphs = graphs if use_graphs else None
            with torch.inference_mode():
                inputs = runner.prepare(batch)
                forward = timed(lambda inputs=inputs: runner.forward_logits(inputs), args.reps)
                step = timed(lambda batch=batch: runner.step(batch), args.reps)
            whole = None  # the engine's loop runs as configured: in the graphs row when captured
            if use_graphs or not graphs:
                release(engine, batch)
                whole = engine_step(engine, bs, args.context, args.reps, seed=i)
                batch = decode_batch(engine, bs, args.context, seed=i)
            row = dict(
                batch=bs,
                graphs=use_graphs,
                floor_ms=floor * 1e3,
                forward_ms=forward * 1e3,
                forward_x=forward / floor,
                step_ms=step * 1e3,
                step_x=step / floor,
                engine_ms=None if whole is None else whole * 1e3,
                engine_x=None if whole is None else whole / floor,
            )
            info["rows"].append(row)
            print(
                f"{bs:>5} {str(use_graphs):>6} {floor * 1e3:>9.3f} {forward * 1e3:>10.3f} "
                f"{forward / floor:>7.2f} {step * 1e3:>8.3f} {step / floor:>7.2f} "
                + (f"{whole * 1e3:>9.3f} {whole / floor:>7.2f}" if whole else f"{'-':>9} {'-':>7}")
            )
        runner.graphs = graphs
        if args.profile and device.type == "cuda":
            profile_steps(runner, batch)
        release(engine, batch)
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
