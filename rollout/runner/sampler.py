"""Sampling on the device: one batched pass, per-row parameters, logprobs before truncation.

Each row draws with inverse-CDF sampling from one uniform number that the host derives from the
request's seed and output index, so a seeded sample does not depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rollout.sampling import SamplingParams
from rollout.transfer import to_device


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor  # float32 [N], 0 = greedy
    top_k: torch.Tensor  # int64 [N], vocab size when off
    top_p: torch.Tensor  # float32 [N]
    min_p: torch.Tensor  # float32 [N]
    uniforms: torch.Tensor  # float64 [N] in (0, 1)
    all_greedy: bool
    needs_sort: bool
    needs_min_p: bool
    num_top_logprobs: int

    @classmethod
    def build(
        cls, params: list[SamplingParams], uniforms: Sequence[float], vocab: int, device: torch.device
    ) -> SamplingBatch:
        # a batch usually holds a handful of distinct SamplingParams objects (one per generate call or
        # prompt): per-row values are gathered from them with numpy and sent in one copy
        distinct = list({id(p): p for p in params}.values())
        if len(distinct) == 1:
            which = np.zeros(len(params), dtype=np.int64)
        else:
            slot = {id(p): i for i, p in enumerate(distinct)}
            which = np.fromiter((slot[id(p)] for p in params), dtype=np.int64, count=len(params))
        floats = np.array([[p.temperature, p.top_p, p.min_p] for p in distinct], dtype=np.float32)[which]
        top_k = np.array([p.top_k if p.top_k > 0 else vocab for p in distinct], dtype=np.int64)[which]
        rows, ints, us = to_device([floats, top_k, np.asarray(uniforms, dtype=np.float64)], device)
        return cls(
            temperatures=rows[:, 0],
            top_p=rows[:, 1],
            min_p=rows[:, 2],
            top_k=ints,
            uniforms=us,
            all_greedy=all(p.greedy for p in distinct),
            needs_sort=any(p.needs_sort for p in distinct),
            needs_min_p=any(p.min_p > 0 and not p.greedy for p in distinct),
            num_top_logprobs=max(p.top_logprobs for p in distinct),
        )


@dataclass
class SampleResult:
    tokens: torch.Tensor  # int64 [N]
    logprobs: torch.Tensor  # float32 [N]
    top_ids: torch.Tensor | None  # int64 [N, K]
    top_logprobs: torch.Tensor | None  # float32 [N, K]


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampleResult:
    """logits: float32 [N, V]."""
    greedy = sb.temperatures == 0
    scale = torch.where(greedy, torch.ones_like(sb.temperatures), sb.temperatures)
    logprobs = torch.log_softmax(logits / scale.unsqueeze(1), dim=-1)
    tokens = logits.argmax(dim=-1)
    if not sb.all_greedy:
        drawn = _draw(logprobs, sb)
        tokens = torch.where(greedy, tokens, drawn)
    top_ids = top_lp = None
    if sb.num_top_logprobs:
        top_lp, top_ids = logprobs.topk(sb.num_top_logprobs, dim=-1)
    return SampleResult(tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1), top_ids, top_lp)


def _draw(logprobs: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Truncate each row (top-k, then top-p on what is left, then min-p) and draw by inverse CDF."""
    order = None
    if not sb.needs_sort:
        probs = _padded_exp(logprobs)
    else:
        probs, order = logprobs.exp().sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[1], device=probs.device)
        probs = probs * (rank.unsqueeze(0) < sb.top_k.unsqueeze(1))
        csum = probs.cumsum(dim=-1)
        # keep a token while the mass ranked above it is below top_p of the (top-k) total
        probs = probs * ((csum - probs) < sb.top_p.unsqueeze(1) * csum[:, -1:])
    if sb.needs_min_p:
        top = probs[:, :1] if order is not None else probs.max(dim=-1, keepdim=True).values
        probs = probs * (probs >= sb.min_p.unsqueeze(1) * top)
    idx = _inverse_cdf(probs, sb.uniforms).unsqueeze(1)
    return idx.squeeze(1) if order is None else order.gather(1, idx).squeeze(1)


CDF_BLOCK = 1024


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row, the index i with cdf[i-1] <= u * total < cdf[i] (unnormalised probs [N, V]).

    Two levels, so no float64 cumsum over the whole vocabulary: the row's blocks of CDF_BLOCK tokens are
    summed, the block holding the target found, then the target found inside that block.
    """
    N, V = probs.shape
    nb = -(-V // CDF_BLOCK)
    if V % CDF_BLOCK:
        probs = F.pad(probs, (0, nb * CDF_BLOCK - V))
    blocks = probs.view(N, nb, CDF_BLOCK)
    # float32 sums of 1024 terms are exact enough; only the short [N, nb] cumsum needs float64
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [N, nb]
    target = (u * block_cdf[:, -1]).unsqueeze(1)  # [N, 1]
    b = _search(block_cdf, target)
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), 0.0)
    inner = blocks.gather(1, b.unsqueeze(-1).expand(N, 1, CDF_BLOCK)).squeeze(1).double().cumsum(dim=-1)
    i = _search(inner, target - before)
    return (b * CDF_BLOCK + i).squeeze(1)


def _padded_exp(logprobs: torch.Tensor) -> torch.Tensor:
    """exp(logprobs) written into a buffer whose width is a multiple of CDF_BLOCK (zeros past the
    vocabulary), so the inverse CDF needs no padded copy."""
    N, V = logprobs.shape
    probs = torch.empty(N, -(-V // CDF_BLOCK) * CDF_BLOCK, dtype=logprobs.dtype, device=logprobs.device)
    torch.exp(logprobs, out=probs[:, :V])
    probs[:, V:].zero_()
    return probs


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """First index whose cdf exceeds target, never past the last index with mass (rounding-safe)."""
    idx = torch.searchsorted(cdf, target, right=True)
    last = (cdf < cdf[:, -1:]).sum(dim=-1, keepdim=True)  # index of the last entry that adds mass
    return torch.minimum(idx, last)
