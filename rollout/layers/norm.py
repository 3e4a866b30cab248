"""RMSNorm computed in float32, as Hugging Face's Llama/Qwen models do."""

from __future__ import annotations

import torch
from torch import nn

from rollout.layers import fused
from rollout.layers.fused import use_fused
from rollout.layers.linear import empty_param


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = empty_param(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(x + residual), x + residual): the decoder's residual add fused
        into the norm that follows it."""
        if residual is not None:
            if use_fused(x):
                return fused.add_rms_norm(x, residual, self.weight, self.eps)
            s = x + residual
            return self.forward(s), s
        if use_fused(x):  # one kernel instead of eight (see layers/fused.py)
            return fused.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def hf_shape(self, param: str, shard: None) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def copy_pair(self, param: str, shard: None, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weight.data, full

    def load(self, param: str, shard: None, full: torch.Tensor) -> None:
        self.weight.data.copy_(full)

    def read(self, param: str, shard: None) -> torch.Tensor:
        return self.weight.data
