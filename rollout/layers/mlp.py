"""The SiLU-gated MLP (down(silu(gate(x)) * up(x))) with gate and up fused into one column-parallel
matrix: the dense MLP of Llama-family decoders and the shared expert of MoE blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout.distributed import SINGLE, TPGroup
from rollout.layers import fused
from rollout.layers.fused import use_fused
from rollout.layers.linear import ColumnLinear, RowLinear


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        bias: bool = False,
        size_name: str = "intermediate_size",  # the config field, named when TP does not divide it
        tp: TPGroup = SINGLE,
        dtype: torch.dtype,
        device=None,
    ):
        super().__init__()
        self.local_inter = tp.shard(intermediate, size_name)
        self.gate_up_proj = ColumnLinear(
            hidden,
            [intermediate, intermediate],
            bias=bias,
            shard_names=[0, 1],
            tp=tp,
            dtype=dtype,
            device=device,
        )
        self.down_proj = RowLinear(intermediate, hidden, bias=bias, tp=tp, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(h)
        if use_fused(gate_up):
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.local_inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)
