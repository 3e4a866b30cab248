"""Top-k with ties broken by the lowest index, as a stable descending sort would pick.

    values, idx = topk_lowest_index_first(x [..., N] float32, k)   # each [..., k], highest first

torch.topk leaves the order of equal values to its kernel, which changes with the device and the
shape of the batch (on the CPU it does not even pick the lowest index), so a token's MoE experts or
a row's top logprobs could depend on the rows around it. Here each entry gets a distinct int64 key,
the float's bits (made to order like the float) above the inverted index: one topk of the keys gives
the order a stable sort gives, without sorting every row, and the values are gathered unchanged.
"""

from __future__ import annotations

import torch

_SHIFT = 2**32  # the value's bits go above any index below 2**32


def topk_lowest_index_first(
    x: torch.Tensor, k: int, *, nonnegative: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int64 indices) of the k largest entries of x's last dim (float32), equal values in
    index order (-0.0 equals 0.0). `nonnegative`: the caller knows x holds no negative value and no
    -0.0 (a softmax), so the sign handling is skipped: one elementwise pass over x instead of four."""
    if x.dtype != torch.float32:
        raise TypeError(f"topk_lowest_index_first takes float32, got {x.dtype}")
    bits = x.view(torch.int32)
    if not nonnegative:
        bits = (x + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
        bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative: larger magnitude, lower key
    n = x.shape[-1]
    inverted = torch.arange(_SHIFT - 1, _SHIFT - 1 - n, -1, device=x.device)  # int64 [n]
    _, idx = torch.add(inverted, bits, alpha=_SHIFT).topk(k, dim=-1)  # bits widen to int64 in the add
    return x.gather(-1, idx), idx
