"""The short causal depthwise convolution (kernel K, SiLU after) in front of a Gated DeltaNet layer.

Each request keeps its last K-1 inputs (the conv state, [C, K-1] per slot of a pool): a prefill chunk
convolves the state followed by its tokens, so a chunk continues exactly where the previous one ended,
and decode shifts one token in. Matches transformers' causal_conv1d_fn / causal_conv1d_update (conv in
the weight's dtype, then SiLU). Both paths are plain torch ops; decode has no host syncs (capturable).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    q_lens: list[int],
) -> torch.Tensor:
    """x: [T, C] (requests' chunks concatenated); weight: [C, K]; pool: [S, C, K-1]. Request b starts from
    pool[slots[b]] (zeros where fresh[b]) and leaves its last K-1 inputs there. Returns SiLU(conv) [T, C]."""
    K = weight.shape[1]
    init = torch.where(fresh.view(-1, 1, 1), 0, pool[slots]).transpose(1, 2).to(x.dtype)  # [B, K-1, C]
    # each request's state rows then its tokens, all requests in one tensor [T + B (K-1), C]
    parts = []
    for b, chunk in enumerate(x.split(q_lens)):
        parts += [init[b], chunk]
    ext = torch.cat(parts).to(weight.dtype)
    lens = torch.tensor(q_lens, device=x.device)
    ends = torch.cumsum(lens + (K - 1), 0)  # exclusive end of each request's section in ext
    starts = ends - lens  # its first token's row
    rows = torch.cat(
        [torch.arange(int(s), int(e), device=x.device) for s, e in zip(starts.tolist(), ends.tolist())]
    )
    out = sum(ext[rows - (K - 1 - j)] * weight[:, j] for j in range(K))
    state_rows = (ends.unsqueeze(1) - (K - 1) + torch.arange(K - 1, device=x.device)).reshape(-1)
    pool.index_copy_(0, slots, ext[state_rows].view(len(q_lens), K - 1, -1).transpose(1, 2).to(pool.dtype))
    return F.silu(out).to(x.dtype)


def decode(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x: [B, C], one token per request; pool[slots] shift in place. Returns SiLU(conv) [B, C]."""
    window = torch.cat([pool[slots].to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (window * weight).sum(-1)
    pool.index_copy_(0, slots, window[..., 1:].to(pool.dtype))
    return F.silu(out).to(x.dtype)
