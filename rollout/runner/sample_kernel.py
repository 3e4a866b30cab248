"""A sort-free sampling kernel: top-k, top-p and min-p truncation and the inverse-CDF draw of each row, in
one Triton program per row.

It makes exactly the decisions of the sort-based reference in sampler.py (`_top_k_top_p`, min-p,
`_inverse_cdf`), without a sort or a cumsum over the vocabulary:
- tokens are ranked by a distinct int64 key, probability bits above the inverted token id, so equal
  probabilities rank by lower id, as the reference's stable sort does;
- what survives top-k and top-p is the set of tokens whose key is at least a cut. The cut is the least
  key t with (count of keys above t) < top_k and (weight of keys above t) < top_p * top-k weight, both
  monotone in t, so it is found by bisection over the key space: one pass over the row per halving;
- weights are the reference's fixed-point integers and every sum is an integer sum, exact in any order,
  so a row's result does not depend on the block size or on the rest of the batch.

No host syncs and a grid that depends only on the batch size: safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _load(row_ptr, start, V, BLOCK: tl.constexpr, ID_BITS: tl.constexpr):
    """One block of a row: (valid lanes, fixed-point weights, keys)."""
    offs = start + tl.arange(0, BLOCK)
    valid = offs < V
    p = tl.load(row_ptr + offs, mask=valid, other=0.0)
    w = (p * 4503599627370496.0).to(tl.int64)  # * 2**52 is exact in float32; the cast floors
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)  # p >= 0: the bits order like the floats
    key = (bits << ID_BITS) | ((1 << ID_BITS) - 1 - offs.to(tl.int64))
    return valid, w, key


@triton.jit
def _above(row_ptr, V, t, BY_COUNT: tl.constexpr, BLOCK: tl.constexpr, ID_BITS: tl.constexpr):
    """Count (BY_COUNT) or weight of the row's tokens whose key is above t."""
    acc = tl.zeros((), dtype=tl.int64)
    for start in range(0, V, BLOCK):
        valid, w, key = _load(row_ptr, start, V, BLOCK, ID_BITS)
        above = valid & (key > t)
        if BY_COUNT:
            acc += tl.sum(above.to(tl.int64))
        else:
            acc += tl.sum(tl.where(above, w, 0))
    return acc


@triton.jit
def _least_key(row_ptr, V, lo, hi, bound, BY_COUNT: tl.constexpr, BLOCK: tl.constexpr, ID_BITS: tl.constexpr):
    """The least t in (lo, hi] with _above(t) < bound, given it holds at hi and not at lo. Compared in
    float64, as the reference compares its int64 sums (< 2**53, exact) with a float64 bound."""
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        ok = _above(row_ptr, V, mid, BY_COUNT, BLOCK, ID_BITS).to(tl.float64) < bound
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid)
    return hi


@triton.jit
def _sample_kernel(
    probs_ptr,
    stride,
    V,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    param_stride,  # top_p and min_p are columns of one [N, 3] float32 tensor (SamplingBatch)
    u_ptr,
    tokens_ptr,
    cuts_ptr,
    BLOCK: tl.constexpr,
    ID_BITS: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = probs_ptr + row.to(tl.int64) * stride
    k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row * param_stride).to(tl.float64)
    total = tl.zeros((), dtype=tl.int64)
    top = tl.zeros((), dtype=tl.int64)
    hi = tl.zeros((), dtype=tl.int64)  # the largest key: it survives every truncation
    for start in range(0, V, BLOCK):
        valid, w, key = _load(row_ptr, start, V, BLOCK, ID_BITS)
        total += tl.sum(w)
        top = tl.maximum(top, tl.max(w))
        hi = tl.maximum(hi, tl.max(tl.where(valid, key, 0)))

    cut = tl.zeros((), dtype=tl.int64)  # no truncation: every key is >= 0
    if k < V:  # the k-th largest key; the top-p bound is a share of the weight from there up
        cut = _least_key(row_ptr, V, cut - 1, hi, k.to(tl.float64), True, BLOCK, ID_BITS)
        total = _above(row_ptr, V, cut - 1, False, BLOCK, ID_BITS)
    if top_p < 1.0:
        cut = _least_key(row_ptr, V, cut - 1, hi, top_p * total.to(tl.float64), False, BLOCK, ID_BITS)

    # min-p against the largest weight (the top token always survives), then the inverse CDF in token
    # order: the token is the number of positions whose running kept weight is <= the target
    floor = tl.load(min_p_ptr + row * param_stride).to(tl.float64) * top.to(tl.float64)
    kept_total = tl.zeros((), dtype=tl.int64)
    for start in range(0, V, BLOCK):
        valid, w, key = _load(row_ptr, start, V, BLOCK, ID_BITS)
        kept_total += tl.sum(tl.where((key >= cut) & (w.to(tl.float64) >= floor), w, 0))
    target = (tl.load(u_ptr + row) * kept_total.to(tl.float64)).to(tl.int64)
    target = tl.minimum(target, kept_total - 1)  # u * total may round up to total: take the last token
    running = tl.zeros((), dtype=tl.int64)
    token = tl.zeros((), dtype=tl.int64)
    for start in range(0, V, BLOCK):
        valid, w, key = _load(row_ptr, start, V, BLOCK, ID_BITS)
        kw = tl.where((key >= cut) & (w.to(tl.float64) >= floor), w, 0)
        cdf = running + tl.cumsum(kw, axis=0)
        token += tl.sum((valid & (cdf <= target)).to(tl.int64))
        running += tl.sum(kw)
    tl.store(tokens_ptr + row, token)
    tl.store(cuts_ptr + row, cut)


def id_bits(vocab: int) -> int:
    return max(1, (vocab - 1).bit_length())


def sample_rows(
    probs: torch.Tensor,
    vocab: int,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """probs: float32 [N, >= vocab] (row stride may exceed vocab). Returns each row's token and cut key
    (int64 [N]): the tokens that survive top-k and top-p are those whose key (`keys`) is >= the cut."""
    N = probs.shape[0]
    assert top_p.stride(0) == min_p.stride(0) and top_k.is_contiguous() and uniforms.is_contiguous()
    tokens = torch.empty(N, dtype=torch.int64, device=probs.device)
    cuts = torch.empty(N, dtype=torch.int64, device=probs.device)
    _sample_kernel[(N,)](
        probs, probs.stride(0), vocab, top_k, top_p, min_p, top_p.stride(0), uniforms, tokens, cuts,
        BLOCK=BLOCK, ID_BITS=id_bits(vocab), num_warps=8,
    )  # fmt: skip
    return tokens, cuts
