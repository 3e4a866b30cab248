"""RMSNorm computed in float32, as Hugging Face's Llama/Qwen models do."""

from __future__ import annotations

import torch
from torch import nn

from rollout.layers.linear import empty_param


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = empty_param(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def hf_shape(self, param: str, shard: None) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def load(self, param: str, shard: None, full: torch.Tensor) -> None:
        self.weight.data.copy_(full)

    def read(self, param: str, shard: None) -> torch.Tensor:
        return self.weight.data
