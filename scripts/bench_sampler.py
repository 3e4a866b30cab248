"""The sampler alone: the sort-based draw it had before issue #15 against the sort-free one, same run.

For each batch size, random float32 logits of the full vocabulary, temperature 1, top_p 0.95 and the
sampled token's logprob (what `logprobs=True` reports), timed through `sample()`:

  old / new    milliseconds per call, synchronised (CUDA events on a GPU), and the ratio old / new
  host         milliseconds the host spends issuing one call (no sync): the launch cost at batch 1
  graph        (CUDA) one replay of the new sampler captured in a CUDA graph
  same         whether old and new drew the same tokens (they make the same decisions exactly)

"flat" logits (std 1, like a randomly initialised model) keep ~95% of the vocabulary; "peaked" ones
(std 5) keep a few hundred tokens.

    python scripts/bench_sampler.py --batch-sizes 1 64 256 --vocab 151936
"""

from __future__ import annotations

import argparse
import time

import torch

from rollout import SamplingParams
from rollout.runner import sampler
from rollout.runner.sampler import SamplingBatch, sample


def timed(fn, reps: int, device: torch.device) -> float:
    """Milliseconds per call, after a warm-up call."""
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def host_ms(fn, reps: int, device: torch.device) -> float:
    """Milliseconds the host takes to issue a call (a sync after each, outside the timing)."""
    total = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        total += time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return total / reps * 1e3


def graphed(fn, device: torch.device):
    """`fn` captured in a CUDA graph: a function that replays it."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # warm-up on a side stream, as torch.cuda.graphs recommends
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def with_draw(draw):
    """`sample` with sampler._draw set to `draw` for the call."""

    def run(logits, sb):
        saved, sampler._draw = sampler._draw, draw
        try:
            return sample(logits, sb)
        finally:
            sampler._draw = saved

    return run


def bench(batch: int, vocab: int, std: float, reps: int, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=gen) * std).to(device)
    params = [SamplingParams(temperature=1.0, top_p=0.95, logprobs=True)] * batch
    us = torch.rand(batch, dtype=torch.float64, generator=gen).tolist()
    sb = SamplingBatch.build(params, us, vocab, device)
    old, new = with_draw(sampler.sort_draw), with_draw(sampler._draw)
    same = torch.equal(old(logits, sb).tokens, new(logits, sb).tokens)
    row = dict(
        batch=batch,
        logits="flat" if std <= 1 else "peaked",
        old=timed(lambda: old(logits, sb), reps, device),
        new=timed(lambda: new(logits, sb), reps, device),
        host_old=host_ms(lambda: old(logits, sb), reps, device),
        host_new=host_ms(lambda: new(logits, sb), reps, device),
        same=same,
    )
    if device.type == "cuda":
        replay = graphed(lambda: new(logits, sb), device)
        row["graph"] = timed(replay, reps, device)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--std", type=float, nargs="+", default=[1.0, 5.0], help="logit std: 1 flat, 5 peaked")
    ap.add_argument("--reps", type=int, default=None, help="calls timed (default: 50 on CUDA, 3 on CPU)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reps = args.reps or (50 if device.type == "cuda" else 3)
    print(f"device {device}, vocab {args.vocab}, top_p 0.95, logprobs on, {reps} calls each")
    print(f"{'batch':>5} {'logits':>6} {'old ms':>9} {'new ms':>9} {'old/new':>8} "
          f"{'host old':>9} {'host new':>9} {'graph ms':>9} same")  # fmt: skip
    for batch in args.batch_sizes:
        for std in args.std:
            r = bench(batch, args.vocab, std, reps, device)
            graph = f"{r['graph']:9.3f}" if "graph" in r else f"{'-':>9}"
            ratio = r["old"] / r["new"]
            print(f"{r['batch']:>5} {r['logits']:>6} {r['old']:9.3f} {r['new']:9.3f} {ratio:8.2f} "
                  f"{r['host_old']:9.3f} {r['host_new']:9.3f} {graph} {r['same']}")  # fmt: skip


if __name__ == "__main__":
    main()
