"""Sampling on the device: one batched pass, per-row parameters, logprobs before truncation.

Each row draws with inverse-CDF sampling from one uniform number that the host derives from the
request's seed and output index, so a seeded sample does not depend on the rest of the batch. For
that, a row's draw is a function of its own logits and parameters alone:
- every row draws in token order (top-k / top-p / min-p only mask tokens);
- orderings are total: tokens rank by probability, equal ones by lower token id (a distinct key each);
- sums are exact: probabilities become integer weights (fixed point), so no reduction order, which
  kernels may pick by the batch's shape, can move a cumulative sum across a token's boundary.

Top-k / top-p without a full-vocabulary sort (issue #15), two paths that make exactly the decisions of
the sort-based reference (`sort_draw`, the sampler before), so seeded tokens did not change:
- CUDA: one Triton program per row finds the cut by bisection and draws (sample_kernel.py); no host
  sync, CUDA-graph capturable;
- elsewhere (the CPU): `torch.topk` candidates decide most rows, the sort the rest (`_cuts`).

On CUDA, logits become logprobs and padded probs in one fused Triton pass (softmax_kernel.py, issue #15
round 2; it reads bf16 logits as well as float32), which also hands the sampling kernel each block's
weight so that a row without truncation is drawn from one block of its probs. The CPU keeps torch's
log_softmax and exp. Adjusted logits (penalties, bias, min_tokens), raw logprobs beside them and
processed logprobs keep their torch steps. The argmax is taken only when some row is greedy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rollout.device.staging import Staging, to_device
from rollout.layers.topk import topk_lowest_index_first
from rollout.runner.logit_adjust import LogitAdjust
from rollout.sampling import SamplingParams


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
    adjusts_logits: bool = False  # a row uses min_tokens, logit_bias or a penalty: `adjust` must be set
    any_greedy: bool = True  # False: no row needs the argmax
    processed: torch.Tensor | None = None  # bool [N], rows with logprobs_mode="processed" (None: none)
    adjust: LogitAdjust | None = None
    logprob_ranks: bool = False  # a row wants its sampled token's rank

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        uniforms: Sequence[float],
        vocab: int,
        device: torch.device,
        staging: Staging | None = None,
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
        top_k = np.array([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in distinct], dtype=np.int64)
        top_k = top_k[which]
        arrays = [floats, top_k, np.asarray(uniforms, dtype=np.float64)]
        any_processed = any(p.logprobs_mode == "processed" for p in distinct)
        if any_processed:
            arrays.append(np.array([p.logprobs_mode == "processed" for p in distinct])[which])
        rows, ints, us, *processed = to_device(arrays, device, staging)
        return cls(
            temperatures=rows[:, 0],
            top_p=rows[:, 1],
            min_p=rows[:, 2],
            top_k=ints,
            uniforms=us,
            all_greedy=all(p.greedy for p in distinct),
            any_greedy=any(p.greedy for p in distinct),
            needs_sort=any(p.needs_sort for p in distinct),
            needs_min_p=any(p.min_p > 0 and not p.greedy for p in distinct),
            num_top_logprobs=max(p.top_logprobs for p in distinct),
            adjusts_logits=any(p.adjusts_logits for p in distinct),
            processed=processed[0] if any_processed else None,
            logprob_ranks=any(p.sample_ranks for p in distinct),
        )


@dataclass
class SampleResult:
    tokens: torch.Tensor  # int64 [N]
    logprobs: torch.Tensor  # float32 [N]
    top_ids: torch.Tensor | None  # int64 [N, K]
    top_logprobs: torch.Tensor | None  # float32 [N, K]
    # with SamplingBatch.logprob_ranks: tokens with a logprob >= the sampled one's (vLLM's rank), int64 [N]
    ranks: torch.Tensor | None = None


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampleResult:
    """logits: float32 (or bf16 / fp16) [N, V]. Reported logprobs: see SamplingParams (raw by default, or
    processed)."""
    greedy = sb.temperatures == 0
    scale = torch.where(greedy, torch.ones_like(sb.temperatures), sb.temperatures)
    raw = logits
    if sb.adjusts_logits:
        logits = sb.adjust.apply(logits.float())
    logprobs, probs, sums = _log_softmax(logits, scale, sb)
    scale = scale.unsqueeze(1)
    # torch documents the first of equal maxima, the lowest id; not needed without a greedy row
    tokens = logits.argmax(dim=-1) if sb.any_greedy else None
    weights = None
    if not sb.all_greedy:
        drawn, kept = _draw(logprobs, sb, probs, sums)
        tokens = drawn if tokens is None else torch.where(greedy, tokens, drawn)
        if sb.processed is not None:
            weights = kept()
    if sb.processed is not None:
        logprobs = _reported(raw.float(), logprobs, weights, scale, greedy, sb)
    elif sb.adjusts_logits:
        logprobs = torch.log_softmax(raw.float() / scale, dim=-1)  # raw: before penalties and bias
    top_ids = top_lp = None
    if sb.num_top_logprobs:
        top_lp, top_ids = topk_lowest_index_first(logprobs, sb.num_top_logprobs)
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=1) if sb.logprob_ranks else None  # one pass, only when asked
    return SampleResult(tokens, chosen.squeeze(1), top_ids, top_lp, ranks)


# Probability 1 in fixed point. A row's probabilities sum to 1 (up to float32 rounding), so its integer
# weights sum to about 2**52: below 2**53, exact in int64 and in float64, whatever the order of addition.
# Tokens under 2**-52 get weight 0, below the resolution of the float64 uniform anyway.
FIXED_ONE = 2**52


def _fixed(probs: torch.Tensor) -> torch.Tensor:
    return (probs * FIXED_ONE).to(torch.int64)  # scaling by a power of two is exact; the cast floors


def _reported(
    raw: torch.Tensor,
    logprobs: torch.Tensor,
    weights: torch.Tensor | None,
    scale: torch.Tensor,
    greedy: torch.Tensor,
    sb: SamplingBatch,
) -> torch.Tensor:
    """Per row, raw logprobs or processed ones: the adjusted distribution restricted to the tokens that
    kept weight in the draw, renormalised (a sampled token always has weight). Greedy rows keep the
    untruncated adjusted logprobs."""
    processed = logprobs
    if weights is not None:
        kept = weights[:, : logprobs.shape[1]] > 0
        cut = logprobs.masked_fill(~kept, float("-inf"))
        cut = cut - torch.logsumexp(cut, dim=-1, keepdim=True)
        processed = torch.where(greedy.unsqueeze(1), logprobs, cut)
    base = torch.log_softmax(raw / scale, dim=-1) if sb.adjusts_logits else logprobs
    return torch.where(sb.processed.unsqueeze(1), processed, base)


def _log_softmax(
    logits: torch.Tensor, scale: torch.Tensor, sb: SamplingBatch
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log_softmax(logits / scale) (scale: [N]) and, from the fused kernel (CUDA), the padded probs
    that the draw takes and their block weights for the sampling kernel (None, None: the draw makes
    its probs)."""
    if not _triton(logits):
        return torch.log_softmax(logits.float() / scale.unsqueeze(1), dim=-1), None, None
    # probs and block weights even when no row draws: one kernel variant, so the same bits (see there)
    V = logits.shape[1]
    cfg = _kernel().launch_config(V)  # block weights over the sampling kernel's blocks
    return _softmax_kernel().log_softmax_rows(logits.contiguous(), scale, _padded(V), cfg["BLOCK"], cfg["NB"])


def _draw(
    logprobs: torch.Tensor,
    sb: SamplingBatch,
    probs: torch.Tensor | None = None,
    block_sums: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """Truncate each row (top-k, then top-p on what is left, then min-p) and draw by inverse CDF.
    Returns the tokens, and a function that gives the integer weights drawn from ([N, V] padded to
    CDF_BLOCK; only processed logprobs need them). probs: exp(logprobs) padded to CDF_BLOCK, if made
    already; block_sums: their weight per sampling-kernel block (softmax_kernel)."""
    probs = _padded_exp(logprobs) if probs is None else probs
    V = logprobs.shape[1]
    if _triton(probs):
        # one program per row, no sort, no host sync (sample_kernel.py)
        tokens, cuts = _kernel().sample_rows(probs, V, sb.top_k, sb.top_p, sb.min_p, sb.uniforms, block_sums)
        return tokens, lambda: _kept_weights(probs, V, cuts if sb.needs_sort else None, sb)
    weights = _kept_weights(probs, V, _cuts(probs, V, sb) if sb.needs_sort else None, sb)
    return _inverse_cdf(weights, sb.uniforms), lambda: weights


def sort_draw(
    logprobs: torch.Tensor,
    sb: SamplingBatch,
    probs: torch.Tensor | None = None,
    block_sums: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """`_draw` as it was before the sort-free paths (issue #15): a full-vocabulary sort for top-k and
    top-p. The reference that tests and scripts/bench_sampler.py compare `_draw` with (block_sums, the
    kernel's shortcut, is not used)."""
    probs = _padded_exp(logprobs) if probs is None else probs
    weights = _fixed(probs)
    if sb.needs_sort:
        weights = weights * _top_k_top_p(probs, sb.top_k, sb.top_p)
    if sb.needs_min_p:
        top = weights.max(dim=-1, keepdim=True).values
        weights = weights * (weights >= sb.min_p.double().unsqueeze(1) * top)
    return _inverse_cdf(weights, sb.uniforms), lambda: weights


def _kept_weights(probs: torch.Tensor, V: int, cuts: torch.Tensor | None, sb: SamplingBatch) -> torch.Tensor:
    """The fixed-point weights of the tokens that survive: key >= the row's cut (top-k and top-p), then
    min-p against the largest weight (the top token always survives)."""
    weights = _fixed(probs)
    if cuts is not None:
        weights = weights * _at_least(probs, V, cuts)
    if sb.needs_min_p:
        top = weights.max(dim=-1, keepdim=True).values
        weights = weights * (weights >= sb.min_p.double().unsqueeze(1) * top)  # exact: weights < 2**53
    return weights


# -- ranking keys: probability bits above the inverted token id, distinct and ordered like the stable
# descending sort (equal probabilities rank by lower id). Probabilities are >= 0, so their bits order
# like the floats.
def _id_bits(V: int) -> int:
    return max(1, (V - 1).bit_length())


def _keys(probs: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    b = _id_bits(V)
    return (probs.view(torch.int32).to(torch.int64) << b) | ((1 << b) - 1 - ids)


def _at_least(probs: torch.Tensor, V: int, cuts: torch.Tensor) -> torch.Tensor:
    """Mask of the tokens whose key is >= the row's cut, without building the keys: compared as
    (probability, id) pairs."""
    b = _id_bits(V)
    p = (cuts >> b).to(torch.int32).view(torch.float32).unsqueeze(1)
    last = ((1 << b) - 1 - (cuts & ((1 << b) - 1))).unsqueeze(1)  # the cut token's id
    ids = torch.arange(probs.shape[1], device=probs.device)
    return (probs > p) | ((probs == p) & (ids <= last))


CANDIDATES = 1024


def _cuts(probs: torch.Tensor, V: int, sb: SamplingBatch) -> torch.Tensor:
    """Each row's least surviving key under top-k then top-p (the torch path: topk, not a sort, of the
    vocabulary). The CANDIDATES most probable tokens decide a row when its kept set ends among them and
    clear of a tie at the last candidate's probability; other rows take the full sort."""
    if V <= CANDIDATES:
        return _least_kept(probs, V, _top_k_top_p(probs, sb.top_k, sb.top_p))
    values, ids = probs[:, :V].topk(CANDIDATES, dim=-1)
    keys, order = _keys(values, ids, V).sort(dim=-1, descending=True)
    values = values.gather(1, order)
    # Rank r's decision needs only the top r probabilities, which topk gets right even through ties:
    # so the number kept, n, is exact. Which token holds a rank is certain above the last candidate's
    # probability (every more probable token is a candidate), and the top-k total is known when
    # top_k <= CANDIDATES or top_k is off.
    w = _fixed(values)
    in_k = torch.arange(CANDIDATES, device=w.device).unsqueeze(0) < sb.top_k.unsqueeze(1)
    w = w * in_k
    csum = w.cumsum(dim=-1)
    total = torch.where(sb.top_k.unsqueeze(1) >= V, _fixed(probs).sum(dim=-1, keepdim=True), csum[:, -1:])
    n = (in_k & ((csum - w) < sb.top_p.double().unsqueeze(1) * total)).sum(dim=-1)
    certain = (values > values[:, -1:]).sum(dim=-1)
    decided = (n <= certain) & ((sb.top_k <= CANDIDATES) | (sb.top_k >= V))
    cuts = keys.gather(1, (n - 1).unsqueeze(1)).squeeze(1)
    rest = (~decided).nonzero().squeeze(1)  # a host sync: this path is for the CPU
    if len(rest):
        mask = _top_k_top_p(probs[rest], sb.top_k[rest], sb.top_p[rest])
        cuts[rest] = _least_kept(probs[rest], V, mask)
    return cuts


def _least_kept(probs: torch.Tensor, V: int, mask: torch.Tensor) -> torch.Tensor:
    keys = _keys(probs[:, :V], torch.arange(V, device=probs.device), V)
    return torch.where(mask[:, :V], keys, torch.iinfo(torch.int64).max).min(dim=-1).values


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (in token order) of the tokens that survive top-k, then top-p over the rest. Decided in order
    of probability, equal ones by lower token id: a stable sort of tokens that start in id order. The
    reference that the sort-free paths reproduce."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    w = _fixed(sorted_probs)
    in_k = torch.arange(w.shape[1], device=w.device).unsqueeze(0) < top_k.unsqueeze(1)
    w = w * in_k
    csum = w.cumsum(dim=-1)
    # keep a token while the mass ranked above it is below top_p of the (top-k) total
    keep = in_k & ((csum - w) < top_p.double().unsqueeze(1) * csum[:, -1:])
    return torch.zeros_like(keep).scatter_(1, order, keep)


def _triton(t: torch.Tensor) -> bool:
    """Whether `t`'s rows go through the Triton kernels: on CUDA, with triton installed."""
    return t.is_cuda and _kernel() is not None and _softmax_kernel() is not None


@functools.cache
def _kernel():
    """The Triton sampling kernel module, or None without triton (imported on first use: the CPU tests
    choose the Triton interpreter before triton is first imported)."""
    try:
        from rollout.runner import sample_kernel
    except ImportError:
        return None
    return sample_kernel


@functools.cache
def _softmax_kernel():
    """The fused log-softmax kernel module (softmax_kernel.py), or None without triton."""
    try:
        from rollout.runner import softmax_kernel
    except ImportError:
        return None
    return softmax_kernel


CDF_BLOCK = 1024


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row, the index i with cdf[i-1] <= floor(u * total) < cdf[i] (int64 weights [N, V]).

    Two levels, so no cumsum over the whole vocabulary: the row's blocks of CDF_BLOCK tokens are summed,
    the block holding the target found, then the target found inside that block. Integer sums are
    exact, so both levels agree with a full cumsum.
    """
    N, V = weights.shape
    nb = -(-V // CDF_BLOCK)
    if V % CDF_BLOCK:
        weights = F.pad(weights, (0, nb * CDF_BLOCK - V))
    blocks = weights.view(N, nb, CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # [N, nb]
    target = (u * block_cdf[:, -1].double()).to(torch.int64).unsqueeze(1)  # [N, 1], in [0, total)
    b = _search(block_cdf, target)
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), 0)
    inner = blocks.gather(1, b.unsqueeze(-1).expand(N, 1, CDF_BLOCK)).squeeze(1).cumsum(dim=-1)
    i = _search(inner, target - before)
    return (b * CDF_BLOCK + i).squeeze(1)


def _padded(V: int) -> int:
    return -(-V // CDF_BLOCK) * CDF_BLOCK


def _padded_exp(logprobs: torch.Tensor) -> torch.Tensor:
    """exp(logprobs) written into a buffer whose width is a multiple of CDF_BLOCK (zeros past the
    vocabulary), so the inverse CDF needs no padded copy."""
    N, V = logprobs.shape
    probs = torch.empty(N, _padded(V), dtype=logprobs.dtype, device=logprobs.device)
    torch.exp(logprobs, out=probs[:, :V])
    probs[:, V:].zero_()
    return probs


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """First index whose cdf exceeds target, never past the last index with mass."""
    idx = torch.searchsorted(cdf, target, right=True)
    last = (cdf < cdf[:, -1:]).sum(dim=-1, keepdim=True)  # index of the last entry that adds mass
    return torch.minimum(idx, last)
