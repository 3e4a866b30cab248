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
  so a row's result does not depend on the block size or on the rest of the batch;
- the inverse-CDF draw sums each block of the kept weights, finds the one block where the running weight
  crosses the target and takes a cumsum of that block only: the full cumsum's answer, since the sums
  are exact. Without truncation (top_k off, top_p 1, min_p 0: the common RL setting) the first pass's
  block weights are the kept ones, so the row is read once, plus one block.

No host syncs and a grid that depends only on the batch size: safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192  # tokens a program loads at once at a real vocabulary: 16 per thread of 16 warps
MIN_BLOCK = 128


@triton.jit
def _load(row_ptr, start, V, BLOCK: tl.constexpr):
    """One block of a row: (token ids, valid lanes, probability bits, probabilities)."""
    offs = start + tl.arange(0, BLOCK)
    valid = offs < V
    p = tl.load(row_ptr + offs, mask=valid, other=0.0)
    return offs, valid, p.to(tl.int32, bitcast=True), p  # p >= 0: its bits order like the floats


@triton.jit
def fixed_weight(p):
    return (p * 4503599627370496.0).to(tl.int64)  # * 2**52 is exact in float32; the cast floors


@triton.jit
def _above(row_ptr, V, b, BY_COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """Count (BY_COUNT) or weight of the row's tokens whose probability bits are above b."""
    acc = tl.zeros((BLOCK,), dtype=tl.int64)  # summed once at the end: no reduction per block
    for start in range(0, V, BLOCK):
        offs, valid, bits, p = _load(row_ptr, start, V, BLOCK)
        above = valid & (bits > b)
        if BY_COUNT:
            acc += above.to(tl.int64)
        else:
            acc += tl.where(above, fixed_weight(p), 0)
    return tl.sum(acc)


@triton.jit
def _least_bits(row_ptr, V, lo, hi, bound, BY_COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """Bisection: the least b in (lo, hi] with _above(b) < bound, given it holds at hi (the row's
    largest bits, nothing above) and not at lo; and _above there. Compared in float64, as the reference
    compares its int64 sums (< 2**53, exact) with a float64 bound."""
    at_hi = tl.zeros((), dtype=tl.int64)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        s = _above(row_ptr, V, mid, BY_COUNT, BLOCK)
        ok = s.to(tl.float64) < bound
        hi = tl.where(ok, mid, hi)
        at_hi = tl.where(ok, s, at_hi)
        lo = tl.where(ok, lo, mid)
    return hi, at_hi


@triton.jit
def _group(row_ptr, V, b, BLOCK: tl.constexpr):
    """Size and largest id of the group of tokens whose probability bits are b."""
    n = tl.zeros((BLOCK,), dtype=tl.int64)
    last = tl.full((BLOCK,), -1, dtype=tl.int32)
    for start in range(0, V, BLOCK):
        offs, valid, bits, p = _load(row_ptr, start, V, BLOCK)
        member = valid & (bits == b)
        n += member.to(tl.int64)
        last = tl.maximum(last, tl.where(member, offs, -1))
    return tl.sum(n), tl.max(last)


@triton.jit
def _nth_id(row_ptr, V, b, nth, BLOCK: tl.constexpr):
    """The id of the nth (from 1) lowest-id token whose probability bits are b: bisection over ids, only
    when a tie group straddles a cut."""
    lo = tl.zeros((), dtype=tl.int32) - 1
    hi = tl.zeros((), dtype=tl.int32) + V - 1
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        n = tl.zeros((BLOCK,), dtype=tl.int64)
        for start in range(0, V, BLOCK):
            offs, valid, bits, p = _load(row_ptr, start, V, BLOCK)
            n += (valid & (bits == b) & (offs <= mid)).to(tl.int64)
        ok = tl.sum(n) >= nth
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid)
    return hi


@triton.jit
def _cut(row_ptr, V, lo, hi, bound, BY_COUNT: tl.constexpr, BLOCK: tl.constexpr, ID_BITS: tl.constexpr):
    """The least key t with (count or weight of keys above t) < bound, searched among probability bits in
    (lo, hi]. Returns the key, its probability bits b, the count or weight above b, and how many of b's
    group survive.

    Bisection finds the probability b of the cut; the members of b's tie group, all of one weight, then
    rank by id, so how many survive is arithmetic."""
    b, above = _least_bits(row_ptr, V, lo, hi, bound, BY_COUNT, BLOCK)
    size, last = _group(row_ptr, V, b, BLOCK)
    unit = tl.where(BY_COUNT, 1, fixed_weight(b.to(tl.float32, bitcast=True)))
    # member j (0-based, in id order) survives while above + j * unit < bound; member 0 does
    j_lo = tl.zeros((), dtype=tl.int64)
    j_hi = size
    while j_hi - j_lo > 1:
        mid = j_lo + (j_hi - j_lo) // 2
        ok = (above + mid * unit).to(tl.float64) < bound
        j_lo = tl.where(ok, mid, j_lo)
        j_hi = tl.where(ok, j_hi, mid)
    kept = j_lo + 1
    cut_id = last
    if kept < size:
        cut_id = _nth_id(row_ptr, V, b, kept, BLOCK)
    key = (b.to(tl.int64) << ID_BITS) | ((1 << ID_BITS) - 1 - cut_id.to(tl.int64))
    return key, b, above, kept


@triton.jit
def _kept(offs, bits, p, cut_bits, cut_id, min_w):
    """Weights of the tokens at or above the cut (a (bits, id) pair) and at or above min-p's weight."""
    w = fixed_weight(p)
    at_least = (bits > cut_bits) | ((bits == cut_bits) & (offs <= cut_id))
    return tl.where(at_least & (w >= min_w), w, 0)


@triton.jit
def _kept_sums(row_ptr, V, cut_bits, cut_id, min_w, BLOCK: tl.constexpr, NB: tl.constexpr):
    """Each block's kept weight (int64 [NB]; zeros past the row's last block)."""
    sums = tl.zeros((NB,), dtype=tl.int64)
    for start in range(0, V, BLOCK):
        offs, valid, bits, p = _load(row_ptr, start, V, BLOCK)
        s = tl.sum(_kept(offs, bits, p, cut_bits, cut_id, min_w))  # a sum, not a cumsum: the cheap part
        sums = tl.where(tl.arange(0, NB) == start // BLOCK, s, sums)
    return sums


@triton.jit
def _inverse_cdf(row_ptr, V, sums, u, cut_bits, cut_id, min_w, BLOCK: tl.constexpr, NB: tl.constexpr):
    """The token at floor(u * kept total) in the kept weights' running sum, from the blocks' weights:
    the first token whose running weight exceeds the target. Only the block where the running weight
    crosses the target needs a cumsum; integer sums make it the full cumsum's answer exactly."""
    total = tl.sum(sums)
    target = (u * total.to(tl.float64)).to(tl.int64)
    target = tl.minimum(target, total - 1)  # u * total may round up to total: take the last token
    blocks = tl.arange(0, NB)
    ends = tl.cumsum(sums, axis=0)  # running weight at each block's end
    b = tl.sum((ends <= target).to(tl.int32))  # the first block ending above the target
    before = tl.sum(tl.where(blocks < b, sums, 0))
    offs, valid, bits, p = _load(row_ptr, b * BLOCK, V, BLOCK)
    cdf = before + tl.cumsum(_kept(offs, bits, p, cut_bits, cut_id, min_w), axis=0)
    # positions whose running weight is <= target: those before the token (the running sum grows)
    return b.to(tl.int64) * BLOCK + tl.sum((valid & (cdf <= target)).to(tl.int64))


@triton.jit
def _truncation(row_ptr, V, k, top_p, min_p, BLOCK: tl.constexpr, NB: tl.constexpr, ID_BITS: tl.constexpr):
    """A row's cut key (top-k, then top-p), min-p's least weight and each block's kept weight."""
    # one pass for the row's range of probabilities and each block's weight: without truncation (the
    # common RL setting) those are the draw's block weights, and the draw reads one block more
    sums = tl.zeros((NB,), dtype=tl.int64)
    lo = tl.full((BLOCK,), 0x7FFFFFFF, dtype=tl.int32)
    hi = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, V, BLOCK):
        offs, valid, bits, p = _load(row_ptr, start, V, BLOCK)
        sums = tl.where(tl.arange(0, NB) == start // BLOCK, tl.sum(fixed_weight(p)), sums)
        lo = tl.minimum(lo, tl.where(valid, bits, 0x7FFFFFFF))
        hi = tl.maximum(hi, bits)
    total = tl.sum(sums)
    lo = tl.min(lo) - 1  # below every token: the searches' predicates fail there
    hi = tl.max(hi)
    # the largest weight: the top token survives everything
    top = fixed_weight(hi.to(tl.float32, bitcast=True))

    cut = tl.zeros((), dtype=tl.int64)  # no truncation: every key is >= 0
    if k < V:  # the k-th largest key; the top-p bound is a share of the weight from there up
        cut, b, _, kept = _cut(row_ptr, V, lo, hi, k.to(tl.float64), True, BLOCK, ID_BITS)
        total = _above(row_ptr, V, b, False, BLOCK) + kept * fixed_weight(b.to(tl.float32, bitcast=True))
        lo = b - 1
    if top_p < 1.0:
        key, _, _, _ = _cut(row_ptr, V, lo, hi, top_p * total.to(tl.float64), False, BLOCK, ID_BITS)
        cut = tl.maximum(cut, key)

    # min-p against the largest weight; integer weights pass a float bound when they reach its ceiling
    floor = min_p * top.to(tl.float64)
    min_w = floor.to(tl.int64)
    min_w = tl.where(min_w.to(tl.float64) < floor, min_w + 1, min_w)
    if (cut > 0) | (min_w > 0):  # truncated: the first pass's block weights are not the kept ones
        cut_bits, cut_id = _split(cut, ID_BITS)
        sums = _kept_sums(row_ptr, V, cut_bits, cut_id, min_w, BLOCK, NB)
    return cut, min_w, sums


@triton.jit
def _split(cut, ID_BITS: tl.constexpr):
    """A key's (probability bits, token id)."""
    return (cut >> ID_BITS).to(tl.int32), ((1 << ID_BITS) - 1 - (cut & ((1 << ID_BITS) - 1))).to(tl.int32)


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
    sums_ptr,  # int64 [N, NB]: each block's weight (softmax_kernel), read when GIVEN_SUMS
    tokens_ptr,
    cuts_ptr,
    BLOCK: tl.constexpr,
    NB: tl.constexpr,  # a power of two >= the row's blocks: the per-block weights' vector
    ID_BITS: tl.constexpr,
    GIVEN_SUMS: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = probs_ptr + row.to(tl.int64) * stride
    k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row * param_stride).to(tl.float64)
    min_p = tl.load(min_p_ptr + row * param_stride).to(tl.float64)
    plain = (k >= V) & (top_p >= 1.0) & (min_p <= 0.0)  # nothing to truncate
    if plain & GIVEN_SUMS:  # the block weights are known: no pass over the row before the draw's block
        cut = tl.zeros((), dtype=tl.int64)
        min_w = tl.zeros((), dtype=tl.int64)
        sums = tl.load(sums_ptr + row.to(tl.int64) * NB + tl.arange(0, NB))
    else:
        cut, min_w, sums = _truncation(row_ptr, V, k, top_p, min_p, BLOCK, NB, ID_BITS)
    cut_bits, cut_id = _split(cut, ID_BITS)
    token = _inverse_cdf(row_ptr, V, sums, tl.load(u_ptr + row), cut_bits, cut_id, min_w, BLOCK, NB)
    tl.store(tokens_ptr + row, token)
    tl.store(cuts_ptr + row, cut)


def id_bits(vocab: int) -> int:
    return max(1, (vocab - 1).bit_length())


def block_size(vocab: int) -> int:
    """BLOCK, or a small vocabulary rounded up to a power of two (no lanes spent past a test
    vocabulary; the result does not depend on the block size)."""
    return min(BLOCK, max(MIN_BLOCK, triton.next_power_of_2(vocab)))


def launch_config(vocab: int) -> dict:
    """The kernel's block, its vector of per-block weights (a power of two, at least 2) and warps."""
    block = block_size(vocab)
    nb = max(2, triton.next_power_of_2(triton.cdiv(vocab, block)))
    return dict(BLOCK=block, NB=nb, num_warps=max(1, min(16, block // 512)))


def sample_rows(
    probs: torch.Tensor,
    vocab: int,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
    block_sums: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """probs: float32 [N, >= vocab] (row stride may exceed vocab). Returns each row's token and cut key
    (int64 [N]): the tokens that survive top-k and top-p are those whose key (`keys`) is >= the cut.

    block_sums: int64 [N, NB] (`launch_config`), the `fixed_weight` weight of each BLOCK of each row's probs
    (softmax_kernel computes them while writing probs); rows without truncation then draw from them."""
    N = probs.shape[0]
    assert top_p.stride(0) == min_p.stride(0) and top_k.is_contiguous() and uniforms.is_contiguous()
    cfg = launch_config(vocab)
    assert block_sums is None or (block_sums.shape == (N, cfg["NB"]) and block_sums.is_contiguous())
    tokens = torch.empty(N, dtype=torch.int64, device=probs.device)
    cuts = torch.empty(N, dtype=torch.int64, device=probs.device)
    _sample_kernel[(N,)](
        probs, probs.stride(0), vocab, top_k, top_p, min_p, top_p.stride(0), uniforms,
        tokens if block_sums is None else block_sums, tokens, cuts,
        ID_BITS=id_bits(vocab), GIVEN_SUMS=block_sums is not None, **cfg,
    )  # fmt: skip
    return tokens, cuts
