"""Benchmark weight sync: time per transport and bucket size, as a ratio to the copy floor.

    python scripts/bench_weight_sync.py [--models qwen2.5-0.5b,qwen2.5-1.5b] [--buckets-mb 32,128,512,1024]

Checkpoints are random, with the real shapes (scripts/models.py, made once; speed does not depend
on the values). The floor is one read and one write of all weight bytes: the time to copy them once
at the device-to-device copy bandwidth measured in the same run (for NCCL, the GPU-to-GPU copy
bandwidth). Transports: in-process tensors, in-process flattened buckets, EngineProcess by CUDA IPC
(shared memory on a CPU), and NCCL broadcast to an EngineProcess on a second GPU when there is one.
Prints a markdown table; *over floor* is (ms - floor ms), and per tensor that excess divided by the
number of tensors (the host cost of a tensor when the data is small).

    python scripts/bench_weight_sync.py --models qwen2.5-0.5b-thin --buckets-mb 128 --device cpu

`--profile` adds, per transport, a cProfile of one more sync at the largest bucket (top functions by
own time): where the time over the floor goes on the host.

A `-thin` shape (scripts/models.py: same names and layer count, hidden size 64) measures the host cost
per tensor on its own: its data moves in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import SHAPES, bench_model, shape_of  # noqa: E402

from integrations import BroadcastSender, sync_weights  # noqa: E402
from rollout import Engine  # noqa: E402
from rollout.process.engine_process import EngineProcess  # noqa: E402


def build(name: str, device: torch.device, dtype: torch.dtype) -> tuple[Path, torch.nn.Module]:
    """The random `name`-shaped checkpoint of scripts/models.py (made once) and its transformers model
    on `device`, the trainer side of the sync."""
    from transformers import AutoModelForCausalLM

    folder = bench_model(name)
    return folder, AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()


def copy_bandwidth(src: torch.device, dst: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second copied src -> dst (each byte read once and written once)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    b.copy_(a)
    times = []
    for _ in range(5):
        _sync(src, dst)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(src, dst)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times)


def _sync(*devices: torch.device) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def profiled(label: str, fn: Callable[[], object], top: int = 14) -> None:
    """One call of `fn` under cProfile, its top functions by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    body = out.getvalue()
    print(f"-- profile: {label}\n{body[body.find('   ncalls') :]}", flush=True)


def timed(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: allocations, IPC handles, NCCL communicator
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    model, target, buckets: list[int], repeat: int, profile: str = "", **kw
) -> list[tuple[int, float]]:
    results = [
        (b, timed(partial(sync_weights, model, target, bucket_bytes=b, **kw), repeat)) for b in buckets
    ]
    if profile:
        bucket = max(buckets)
        profiled(
            f"{profile}, {bucket / 2**20:g} MB",
            partial(sync_weights, model, target, bucket_bytes=bucket, **kw),
        )
    return results


def measure_update(
    engine: Engine, model: torch.nn.Module, repeat: int, profile: bool
) -> list[tuple[int, float]]:
    """Engine.update_weights_from_tensor of every weight at once, already in the engine's dtype (the
    trainer's cast not counted)."""
    named = [(n, p.detach().to(engine.dtype)) for n, p in model.named_parameters()]
    device = engine.device

    def update() -> None:
        engine.update_weights_from_tensor(named)
        _sync(device)

    result = [(0, timed(update, repeat))]
    if profile:
        profiled("update_weights_from_tensor, list", update)
    return result


def bench_one(name: str, args, device: torch.device, rows: list[str]) -> None:
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    folder, model = build(name, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    print(
        f"# {name}: {tensors} tensors, {weight_bytes / 1e9:.3f} GB of weights, "
        f"built in {time.perf_counter() - t0:.0f}s"
    )
    bandwidth = copy_bandwidth(device, device)
    floor = weight_bytes / bandwidth
    print(f"# copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write), floor {floor * 1e3:.3f} ms")
    opts = dict(device=str(device), dtype=args.dtype, max_total_tokens=2048)
    buckets = [int(mb * 2**20) for mb in args.buckets_mb]

    def record(transport: str, results: list[tuple[int, float]], floor_s: float) -> None:
        for bucket, seconds in results:
            over = seconds - floor_s
            row = (
                f"| {name} | {transport} | {f'{bucket / 2**20:g} MB' if bucket else '-'} | "
                f"{seconds * 1e3:.2f} | {weight_bytes / seconds / 1e9:.1f} | {floor_s * 1e3:.3f} | "
                f"{seconds / floor_s:.2f} | {over * 1e3:.2f} | {over / tensors * 1e6:.1f} |"
            )
            rows.append(row)
            print(row, flush=True)

    engine = Engine(str(folder), **opts)
    prof = args.profile
    record("update_weights_from_tensor, list", measure_update(engine, model, args.repeat, prof), floor)
    for transport, kw in (("in-process, tensors", {}), ("in-process, flattened", {"flatten": True})):
        results = measure(model, engine, buckets, args.repeat, transport if prof else "", **kw)
        record(transport, results, floor)
    engine = None  # free its weights before the next engine loads
    ipc = "CUDA IPC" if device.type == "cuda" else "shared memory"
    with EngineProcess(str(folder), **opts) as proc:
        label = f"EngineProcess, {ipc}"
        record(label, measure(model, proc, buckets, args.repeat, label if prof else ""), floor)
    if device.type == "cuda" and torch.cuda.device_count() >= 2 and not args.no_nccl:
        other = torch.device("cuda", (device.index or 0) + 1)
        p2p_floor = weight_bytes / copy_bandwidth(device, other)
        with EngineProcess(str(folder), **{**opts, "device": str(other)}) as proc:
            with BroadcastSender.for_engine(proc, "nccl", device=device, timeout=300) as sender:
                record(f"NCCL broadcast -> {other}", measure(model, sender, buckets, args.repeat), p2p_floor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--models", default="qwen2.5-0.5b,qwen2.5-1.5b", help=f"comma list of {sorted(SHAPES)} (or NAME-thin)"
    )
    ap.add_argument("--buckets-mb", default="32,128,512,1024")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-nccl", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile one sync per transport")
    args = ap.parse_args()
    args.buckets_mb = [float(x) for x in args.buckets_mb.split(",")]
    for model in args.models.split(","):
        shape_of(model.strip())  # an unknown name fails before anything is built
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"weight sync on {name}, {args.dtype}; floor = copy all weight bytes once; median of {args.repeat}")
    rows: list[str] = []
    for model in args.models.split(","):
        bench_one(model.strip(), args, device, rows)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        "\n| model | transport | bucket | ms | GB/s | floor ms | x floor | over floor ms | us/tensor |"
        "\n|---|---|---|---|---|---|---|---|---|"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
