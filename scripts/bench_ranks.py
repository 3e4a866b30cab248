"""What `logprob_ranks` (vLLM's Logprob.rank, the sampled token's place in the distribution) adds to
one `sample()` call: the same random full-vocabulary logits sampled with logprobs, without and with
ranks, in the same run. Off, the sampler runs no extra work (checked: `ranks is None`).

    python scripts/bench_ranks.py --batch-sizes 1 64 256 --vocab 151936

Prints milliseconds per call (CUDA events on a GPU, synchronised) and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from rollout import SamplingParams
from rollout.runner.sampler import SamplingBatch, sample


def timed(logits: torch.Tensor, sb: SamplingBatch, iters: int) -> float:
    for _ in range(3):
        sample(logits, sb)
    sync = torch.cuda.synchronize if logits.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        sample(logits, sb)
    sync()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {device}, vocab {a.vocab}")
    print(f"{'batch':>6} {'off ms':>8} {'ranks ms':>9} {'ratio':>6}")
    for n in a.batch_sizes:
        logits = torch.randn(n, a.vocab, device=device)
        us = [0.5] * n
        off = SamplingBatch.build([SamplingParams(logprobs=True)] * n, us, a.vocab, device)
        on = SamplingBatch.build([SamplingParams(logprobs=True, logprob_ranks=True)] * n, us, a.vocab, device)
        assert sample(logits, off).ranks is None and sample(logits, on).ranks is not None
        t_off, t_on = timed(logits, off, a.iters), timed(logits, on, a.iters)
        print(f"{n:>6} {t_off:>8.3f} {t_on:>9.3f} {t_on / t_off:>6.2f}")


if __name__ == "__main__":
    main()
