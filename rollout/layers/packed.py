"""Parameters whose Hugging Face tensor stacks several head-sharded parts along dim 0.

Gated DeltaNet checkpoints keep q, k and v of every head in one `in_proj_qkv` (and in one depthwise
`conv1d`): under tensor parallelism each part is split over the ranks on its own, so a rank holds its
heads of q, of k and of v. One part (a plain column-parallel matrix or a per-head vector) is the
special case. Loadable like layers/linear.py: hf_shape, load, copy_pair, read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout.distributed import SINGLE, TPGroup
from rollout.layers.linear import empty_param


class Packed(nn.Module):
    """`weight`: this rank's rows of each part, in part order; the rest of the shape is whole.
    Called on x it is a linear layer (x @ weight^T)."""

    lora = None  # a rollout.lora.LoraLinear when the model lists this module as a LoRA target

    def __init__(
        self,
        parts: list[int],
        rest: tuple[int, ...],
        *,
        tp: TPGroup = SINGLE,
        dtype: torch.dtype,
        device=None,
        what: str = "a packed size",
    ):
        super().__init__()
        self.tp, self.parts, self.rest = tp, list(parts), tuple(rest)
        self.local = [tp.shard(p, what) for p in parts]
        self.weight = empty_param(sum(self.local), *rest, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.lora is not None:
            self.lora.apply(x, y)
        return y

    def hf_shape(self, param: str, shard: None) -> tuple[int, ...]:
        return (sum(self.parts), *self.rest)

    def copy_pair(self, param: str, shard: None, full: torch.Tensor):
        # one plain copy only when nothing is split; else `load` copies part by part
        return (self.weight.data, full) if self.tp.size == 1 else None

    def load(self, param: str, shard: None, full: torch.Tensor) -> None:
        src = dst = 0
        for whole, n in zip(self.parts, self.local):
            self.weight.data.narrow(0, dst, n).copy_(full.narrow(0, src + self.tp.rank * n, n))
            src, dst = src + whole, dst + n
        return None

    def read(self, param: str, shard: None) -> torch.Tensor:
        if self.tp.size == 1:
            return self.weight.data
        pieces = self.weight.data.split(self.local)
        return torch.cat([self.tp.all_gather(p, dim=0) for p in pieces])
