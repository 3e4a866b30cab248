"""Release/resume time per memory tag for an engine with a large KV pool (default: the Qwen2.5-1.5B shape).

Needs a CUDA GPU and torch_memory_saver. The checkpoint is random (speed does not depend on values) with
the real shapes, built once with transformers' Qwen2Config in bf16.

    python scripts/bench_memory.py                      # mem_fraction 0.85, 5 repeats
    python scripts/bench_memory.py --mem-fraction 0.6 --repeats 10 --ckpt /tmp/qwen25-15b
    python scripts/bench_memory.py --model qwen2.5-7b   # another scripts/models.py shape

Prints a markdown table (medians over the repeats): the host time of each call, the time until the
device is idle after resume (the KV pool is zeroed on resume, asynchronously), and the memory each
release gave back as torch.cuda.mem_get_info sees it; then torch_memory_saver's own pause/resume of one
region of the same bytes (KV pool, weight storage) in the same run, and the engine's ratio to it. Target:
kv_cache and cuda_graph release/resume and weights release/resume without backup under 50 ms each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import SHAPES, bench_model  # noqa: E402

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.weights.loader import iter_checkpoint, load_tensors, safetensors_files  # noqa: E402

GiB = 2**30


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def resend_weights(engine: Engine, host_weights: list[tuple[str, torch.Tensor]]) -> float:
    t0 = time.perf_counter()
    if hasattr(engine, "update_weights_from_tensor"):
        engine.update_weights_from_tensor(host_weights)
    else:  # before the weights helper's update lands
        load_tensors(engine.model, host_weights)
        engine._mark_weights_loaded([n for n, _ in host_weights])
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def measure(engine: Engine, tag: str, keep: bool, repeats: int, host_weights) -> dict[str, float]:
    rows = []
    for _ in range(repeats):
        f0 = free_bytes()
        t0 = time.perf_counter()
        engine.release_memory_occupation(tags=[tag], keep_weights_backup=keep)
        t1 = time.perf_counter()
        f1 = free_bytes()
        t2 = time.perf_counter()
        engine.resume_memory_occupation(tags=[tag])
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        f2 = free_bytes()
        if tag == "weights" and not keep:
            resend_weights(engine, host_weights)
        rows.append(((t1 - t0) * 1e3, (t3 - t2) * 1e3, (t4 - t2) * 1e3, (f1 - f0) / GiB, (f1 - f2) / GiB))
    cols = zip(*rows)
    keys = ("release_ms", "resume_ms", "resume_idle_ms", "freed_gib", "restored_gib")
    return {k: statistics.median(c) for k, c in zip(keys, cols)}


def raw_primitive(nbytes: int, repeats: int, parked: list) -> tuple[float, float]:
    """Median ms of torch_memory_saver's own pause and resume (until idle) of one region of `nbytes`,
    in this process and mode: the floor of the engine's release/resume of the same bytes. The block is
    left paused in `parked`: freeing it would return it to torch_memory_saver's pool, not to the device,
    and the engine's resume needs those bytes."""
    import torch_memory_saver

    tms = torch_memory_saver.torch_memory_saver
    tag = f"bench_raw_{len(parked)}"  # its own tag: a paused earlier block must stay paused
    with tms.region(tag=tag):
        block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pauses, resumes = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tms.pause(tag)
        t1 = time.perf_counter()
        tms.resume(tag)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        pauses.append((t1 - t0) * 1e3)
        resumes.append((t2 - t1) * 1e3)
    tms.pause(tag)  # the device memory goes back; the paused tensor is kept, never touched again
    parked.append(block)
    return statistics.median(pauses), statistics.median(resumes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(SHAPES), help="the random shape")
    ap.add_argument("--ckpt", type=Path, default=None, help="where to build/reuse the random checkpoint")
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_memory.py needs a CUDA GPU")
    try:
        import torch_memory_saver  # noqa: F401
    except ImportError:
        raise SystemExit("bench_memory.py needs torch_memory_saver: pip install torch-memory-saver") from None

    ckpt = bench_model(args.model, args.ckpt)
    host_weights = [(n, t.pin_memory()) for n, t in iter_checkpoint(safetensors_files(ckpt))]
    a = torch.randn(256, 256, device="cuda")
    (a @ a).sum().item()  # CUDA context and cuBLAS before the baseline
    torch.cuda.empty_cache()
    free_start = free_bytes()

    engine = Engine(str(ckpt), enable_memory_saver=True, mem_fraction=args.mem_fraction)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 150000, (32, 128), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
    torch.cuda.empty_cache()
    free_loaded = free_bytes()

    results = {
        "kv_cache": measure(engine, "kv_cache", False, args.repeats, host_weights),
        "cuda_graph": measure(engine, "cuda_graph", False, args.repeats, host_weights),
        "weights (no backup)": measure(engine, "weights", False, args.repeats, host_weights),
        "weights (host backup)": measure(engine, "weights", True, args.repeats, host_weights),
    }

    # one RL-style cycle: release everything, staged wake with a weight push in between
    t0 = time.perf_counter()
    engine.release_memory_occupation()
    release_all_ms = (time.perf_counter() - t0) * 1e3
    free_released = free_bytes()
    t0 = time.perf_counter()
    engine.resume_memory_occupation(tags=["weights"])
    wake_weights_ms = (time.perf_counter() - t0) * 1e3
    push_ms = resend_weights(engine, host_weights)
    t0 = time.perf_counter()
    engine.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
    wake_rest_ms = (time.perf_counter() - t0) * 1e3
    free_resumed = free_bytes()
    out = [o.outputs[0].token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]

    # the raw primitive on the same bytes, each while the engine's own copy is released (room for it)
    raw, parked = {}, []
    for tag, nbytes in (
        ("kv_cache", engine.kv.nbytes),
        ("weights (no backup)", engine.model.weight_storage.numel()),
    ):
        engine_tag = tag.split()[0]
        engine.release_memory_occupation(tags=[engine_tag])
        raw[tag] = raw_primitive(nbytes, args.repeats, parked)
        engine.resume_memory_occupation(tags=[engine_tag])
        if engine_tag == "weights":
            resend_weights(engine, host_weights)

    name = torch.cuda.get_device_name()
    print(f"\n### Memory release/resume: {args.model} shape (bf16), {name}, torch {torch.__version__}")
    kv_gib = engine.kv.nbytes / GiB
    print(f"KV pool {engine.pool_tokens} tokens ({kv_gib:.1f} GiB), medians of {args.repeats} cycles\n")
    print("| tag | release (ms) | resume call (ms) | resume until idle (ms) | freed (GiB) | restored (GiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for tag, r in results.items():
        print(
            f"| {tag} | {r['release_ms']:.1f} | {r['resume_ms']:.1f} | {r['resume_idle_ms']:.1f} "
            f"| {r['freed_gib']:.2f} | {r['restored_gib']:.2f} |"
        )
    print("\ntorch_memory_saver's own pause/resume of the same bytes (one region), and the engine's ratio:\n")
    print("| tag | raw pause (ms) | raw resume until idle (ms) | release / raw | resume until idle / raw |")
    print("|---|---:|---:|---:|---:|")
    for tag, (pause_ms, resume_ms) in raw.items():
        r = results[tag]
        print(
            f"| {tag} | {pause_ms:.1f} | {resume_ms:.1f} | {r['release_ms'] / pause_ms:.2f} "
            f"| {r['resume_idle_ms'] / resume_ms:.2f} |"
        )
    print(
        f"\nFull cycle: release all {release_all_ms:.1f} ms; staged wake: weights {wake_weights_ms:.1f} ms, "
        f"weight push from pinned host {push_ms:.1f} ms, kv_cache + cuda_graph {wake_rest_ms:.1f} ms"
    )
    stages = {"before the engine": free_start, "engine loaded": free_loaded}
    stages.update({"all released": free_released, "all resumed": free_resumed})
    print("Free GPU memory (GiB): " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in stages.items()))
    footprint = free_start - free_loaded
    print(f"Released {(free_released - free_loaded) / max(footprint, 1):.1%} of the engine's footprint")
    print(f"Greedy outputs after the cycles equal the first ones: {out == ref}")
    if out != ref:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
