"""The sampler alone, three ways in the same run, timed through `sample()`:

  sort    the sampler before issue #15: torch's logits / temperature, log_softmax and exp, then a
          full-vocabulary sort for top-k / top-p (`sampler.sort_draw`); the argmax taken
  torch   round 1 of #15: the same torch steps and argmax, then the sampling kernel reading the whole
          row (this tree's kernel: check out the commit before it for round 1's own)
  fused   now: the fused log-softmax kernel (softmax_kernel.py) writes logprobs, probs and block
          weights; the sampling kernel takes them (on the CPU all three are torch: `fused` = `torch`)

For each batch size and setting, random logits of the full vocabulary (float32, or --dtype bfloat16 as
the lm head makes them) and the sampled token's logprob (what `logprobs=True` reports):

  sort / torch / fused   milliseconds per call, synchronised (CUDA events on a GPU)
  x torch                torch / fused
  host                   milliseconds the host spends issuing one fused call (no sync)
  graph                  (CUDA) one replay of the fused sampler captured in a CUDA graph
  exact                  whether the fused path drew what the sort-based reference draws from the
                         same probabilities (it makes the same decisions exactly)
  agree                  the share of rows where the fused and torch paths drew the same token (their
                         probabilities differ by float rounding, so a rare row may differ)

Settings: "rl" is temperature 1 and no truncation (the GRPO case, the sampling kernel's shortcut);
"top_p" is top_p 0.95. "flat" logits (std 1, like a randomly initialised model) keep ~95% of the
vocabulary under top_p; "peaked" ones (std 5) a few hundred tokens.

    python scripts/bench_sampler.py --batch-sizes 1 64 256 512 --vocab 151936
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from rollout import SamplingParams
from rollout.runner import sampler
from rollout.runner.sampler import SamplingBatch, sample

SETTINGS = {"rl": dict(temperature=1.0), "top_p": dict(temperature=1.0, top_p=0.95)}


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


def _torch_log_softmax(logits, scale, sb):
    """`sampler._log_softmax` before the fused kernel: torch steps, probs left to the draw."""
    return torch.log_softmax(logits.float() / scale.unsqueeze(1), dim=-1), None, None


def patched(**attrs):
    """`sample` with the given sampler attributes replaced for the call."""

    def run(logits, sb):
        saved = {name: getattr(sampler, name) for name in attrs}
        for name, value in attrs.items():
            setattr(sampler, name, value)
        try:
            return sample(logits, sb)
        finally:
            for name, value in saved.items():
                setattr(sampler, name, value)

    return run


PATHS = {
    "sort": patched(_log_softmax=_torch_log_softmax, _draw=sampler.sort_draw),
    "torch": patched(_log_softmax=_torch_log_softmax),
    "fused": sample,
}


def exact(logits: torch.Tensor, sb: SamplingBatch) -> bool:
    """The fused path's tokens against the sort-based reference on the fused path's own probs."""
    scale = torch.where(sb.temperatures == 0, torch.ones_like(sb.temperatures), sb.temperatures)
    logprobs, probs, _ = sampler._log_softmax(logits, scale, sb)
    return torch.equal(sample(logits, sb).tokens, sampler.sort_draw(logprobs, sb, probs)[0])


def bench(batch: int, vocab: int, setting: str, std: float, dtype, reps: int, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=gen) * std).to(device=device, dtype=dtype)
    params = [SamplingParams(**SETTINGS[setting], logprobs=True)] * batch
    us = torch.rand(batch, dtype=torch.float64, generator=gen).tolist()
    sb = SamplingBatch.build(params, us, vocab, device)
    old_sb = dataclasses.replace(sb, any_greedy=True)  # the argmax, which the fused path skips here
    row = dict(batch=batch, setting=setting, logits="flat" if std <= 1 else "peaked")
    for name, fn in PATHS.items():
        args = (logits, sb if name == "fused" else old_sb)
        row[name] = timed(lambda fn=fn, args=args: fn(*args), reps, device)
    row["host"] = host_ms(lambda: sample(logits, sb), reps, device)
    row["exact"] = exact(logits, sb)
    row["agree"] = (PATHS["torch"](logits, sb).tokens == sample(logits, sb).tokens).float().mean().item()
    if device.type == "cuda":
        replay = graphed(lambda: sample(logits, sb), device)
        row["graph"] = timed(replay, reps, device)
    return row


def line(r: dict) -> str:
    graph = f"{r['graph']:9.3f}" if "graph" in r else f"{'-':>9}"
    times = " ".join(f"{r[name]:9.3f}" for name in PATHS)
    return (f"{r['batch']:>5} {r['setting']:>7} {r['logits']:>6} {times} {r['torch'] / r['fused']:8.2f} "
            f"{r['host']:8.3f} {graph} {r['exact']!s:>5} {r['agree']:5.3f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256, 512])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=["rl", "top_p"])
    ap.add_argument("--std", type=float, nargs="+", default=[1.0, 5.0], help="logit std: 1 flat, 5 peaked")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the logits' dtype")
    ap.add_argument("--reps", type=int, default=None, help="calls timed (default: 50 on CUDA, 3 on CPU)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reps = args.reps or (50 if device.type == "cuda" else 3)
    dtype = getattr(torch, args.dtype)
    print(f"device {device}, vocab {args.vocab}, {args.dtype} logits, logprobs on, {reps} calls each")
    print(f"{'batch':>5} {'setting':>7} {'logits':>6} {'sort ms':>9} {'torch ms':>9} {'fused ms':>9} "
          f"{'x torch':>8} {'host ms':>8} {'graph ms':>9} exact agree")  # fmt: skip
    for batch in args.batch_sizes:
        for setting in args.settings:
            for std in args.std:
                print(line(bench(batch, args.vocab, setting, std, dtype, reps, device)))


if __name__ == "__main__":
    main()
