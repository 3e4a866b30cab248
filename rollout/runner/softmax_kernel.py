"""Logits to the sampler's inputs in one Triton program per row: the temperature-scaled log-softmax, the
probabilities padded with zeros to a width the inverse CDF wants, and, for the sampling kernel, each
block's fixed-point weight.

The torch sequence it replaces wrote [N, V] four times (logits / temperature, log_softmax, exp, the
padding). Here a row's logits are read twice and each output written once:
- pass 1: per lane, an online maximum and sum of exponentials (rescaled when the maximum grows); the
  lanes are combined once at the end;
- pass 2: logprob = (z - max) - log(sum), as torch.log_softmax computes it; prob = exp(logprob).

float32 or bfloat16 (or float16) logits are read and converted in registers: the conversion to float32
is exact, so a bf16 row gives the values its float32 cast would. Each program reduces its own row in an
order fixed by the block size and the compiled code, so a row's bits do not depend on the rest of the
batch. There is one compiled variant, every output always written: on an H100 a variant that skipped
the probabilities gave logprobs an ulp apart (its reductions ordered differently), which would have
made a greedy row's logprobs depend on whether another row of its batch samples.

The block weights are `sample_kernel.fixed_weight` of the stored probabilities summed over the sampling
kernel's blocks (its BLOCK): with them that kernel skips its first pass over a row that it does not
truncate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.runner.sample_kernel import fixed_weight


@triton.jit
def _scaled(row_ptr, start, V, t, BLOCK: tl.constexpr):
    """One block of a row's logits over the temperature (-inf past the vocabulary), and its ids."""
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
    return x.to(tl.float32) / t, offs


@triton.jit
def _log_softmax_kernel(
    x_ptr,
    x_stride,
    scale_ptr,
    lp_ptr,
    lp_stride,
    probs_ptr,
    probs_stride,
    sums_ptr,
    V,
    WIDTH,  # the probabilities' padded width (>= V)
    BLOCK: tl.constexpr,
    NB: tl.constexpr,  # a power of two >= the row's blocks: the block weights' vector
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    t = tl.load(scale_ptr + row)
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        z, _ = _scaled(x_row, start, V, t, BLOCK)
        new = tl.maximum(m, z)
        ref = tl.where(new == float("-inf"), 0.0, new)  # a lane that saw only -inf: no -inf - -inf
        s = s * tl.exp(m - ref) + tl.exp(z - ref)
        m = new
    top = tl.max(m, axis=0)
    log_sum = tl.log(tl.sum(s * tl.exp(m - top), axis=0))

    sums = tl.zeros((NB,), dtype=tl.int64)
    for start in range(0, WIDTH, BLOCK):  # the padding's zeros are written too
        z, offs = _scaled(x_row, start, V, t, BLOCK)
        lp = (z - top) - log_sum
        tl.store(lp_ptr + row * lp_stride + offs, lp, mask=offs < V)
        p = tl.where(offs < V, tl.exp(lp), 0.0)
        tl.store(probs_ptr + row * probs_stride + offs, p, mask=offs < WIDTH)
        # past the vocabulary (a block smaller than the padding) p is 0: no entry to set
        sums = tl.where(tl.arange(0, NB) == start // BLOCK, tl.sum(fixed_weight(p), axis=0), sums)
    tl.store(sums_ptr + row * NB + tl.arange(0, NB), sums)


def log_softmax_rows(
    logits: torch.Tensor, scale: torch.Tensor, width: int, sum_block: int, sum_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits: float32 / bf16 / fp16 [N, V] (rows contiguous); scale: float32 [N] (the temperatures, 1 on
    greedy rows). Returns float32 log_softmax(logits / scale) [N, V]; exp of it in [N, width] with
    zeros past V; the int64 [N, sum_blocks] fixed-point weight of each sum_block tokens (zeros past the
    row; sum_blocks a power of two >= V / sum_block).

    Every output is written on every call, even where a caller needs only the logprobs: one kernel
    variant, so the same bits (see the module docstring)."""
    N, V = logits.shape
    assert logits.stride(1) == 1 and scale.is_contiguous() and scale.shape == (N,)
    assert width >= V and sum_blocks >= triton.cdiv(V, sum_block)
    dev = logits.device
    lp = torch.empty(N, V, dtype=torch.float32, device=dev)
    probs = torch.empty(N, width, dtype=torch.float32, device=dev)
    sums = torch.empty(N, sum_blocks, dtype=torch.int64, device=dev)
    _log_softmax_kernel[(N,)](
        logits, logits.stride(0), scale.float(), lp, lp.stride(0), probs, probs.stride(0), sums, V, width,
        BLOCK=sum_block, NB=sum_blocks, num_warps=max(1, min(16, sum_block // 512)),
    )  # fmt: skip
    return lp, probs, sums
