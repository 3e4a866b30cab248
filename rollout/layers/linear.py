"""Linear layers that load Hugging Face weights into fused, tensor-parallel shards.

Every loadable layer answers three questions about a named parameter and shard: the full Hugging Face
shape it expects (`hf_shape`), how to copy a full tensor in (`load`), and how to read it back (`read`).
Loads copy into the existing storage, so CUDA graphs and memory-saver regions stay valid.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from rollout.distributed import SINGLE, TPGroup

Shard = int | str | None
_DEFERRED = contextvars.ContextVar("rollout_deferred_params", default=False)


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    device = "meta" if _DEFERRED.get() else device
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


@contextmanager
def deferred_params() -> Iterator[None]:
    """Parameters made inside are meta tensors, to be placed afterwards (weights/loader.build_model puts
    them all in one storage); buffers and everything else are made as usual."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


class ColumnLinear(nn.Module):
    """y = x W^T + b with W's rows split over TP ranks; several HF matrices may be stacked (fused)."""

    lora = None  # a rollout.lora.LoraLinear when the engine has adapter slots (max_loras > 0)

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        *,
        bias: bool,
        shard_names: list[Shard],
        tp: TPGroup = SINGLE,
        dtype: torch.dtype,
        device=None,
    ):
        super().__init__()
        self.tp = tp
        self.out_sizes = list(out_sizes)
        self.local_sizes = [tp.shard(n, "a fused output size") for n in out_sizes]
        self.shard_names = list(shard_names)
        self.in_features = in_features
        self.weight = empty_param(sum(self.local_sizes), in_features, dtype=dtype, device=device)
        self.bias = empty_param(sum(self.local_sizes), dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora.apply(x, y)
        return y

    def _rows(self, shard: Shard) -> tuple[int, int, int]:
        i = self.shard_names.index(shard)
        start = sum(self.local_sizes[:i])
        return i, start, self.local_sizes[i]

    def hf_shape(self, param: str, shard: Shard) -> tuple[int, ...]:
        i = self.shard_names.index(shard)
        return (self.out_sizes[i], self.in_features) if param == "weight" else (self.out_sizes[i],)

    def copy_pair(self, param: str, shard: Shard, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(destination view, source view): this rank's rows of `full` go to the shard's rows."""
        _, start, n = self._rows(shard)
        return getattr(self, param).data.narrow(0, start, n), full.narrow(0, self.tp.rank * n, n)

    def load(self, param: str, shard: Shard, full: torch.Tensor) -> None:
        dst, src = self.copy_pair(param, shard, full)
        dst.copy_(src)

    def read(self, param: str, shard: Shard) -> torch.Tensor:
        _, start, n = self._rows(shard)
        return self.tp.all_gather(getattr(self, param).data.narrow(0, start, n), dim=0)


class RowLinear(nn.Module):
    """y = x W^T + b with W's columns split over TP ranks; partial sums are all-reduced."""

    lora = None  # a rollout.lora.LoraLinear when the engine has adapter slots (max_loras > 0)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        tp: TPGroup = SINGLE,
        dtype: torch.dtype,
        device=None,
    ):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.local_in = tp.shard(in_features, "a row-parallel input size")
        self.weight = empty_param(out_features, self.local_in, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.lora is not None:  # before the all-reduce: the adapter's partial sums add up like W's
            self.lora.apply(x, y)
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def hf_shape(self, param: str, shard: Shard) -> tuple[int, ...]:
        return (self.out_features, self.in_features) if param == "weight" else (self.out_features,)

    def copy_pair(self, param: str, shard: Shard, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if param == "weight":
            full = full.narrow(1, self.tp.rank * self.local_in, self.local_in)
        return getattr(self, param).data, full

    def load(self, param: str, shard: Shard, full: torch.Tensor) -> None:
        dst, src = self.copy_pair(param, shard, full)
        dst.copy_(src)

    def read(self, param: str, shard: Shard) -> torch.Tensor:
        data = getattr(self, param).data
        return self.tp.all_gather(data, dim=1) if param == "weight" else data


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every TP rank: small matrices every rank needs in full (an MoE
    router's [experts, hidden], a shared expert's [1, hidden] gate)."""

    shard_names = (None,)

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def hf_shape(self, param: str, shard: Shard) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def copy_pair(self, param: str, shard: Shard, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weight.data, full

    def load(self, param: str, shard: Shard, full: torch.Tensor) -> None:
        self.weight.data.copy_(full)

    def read(self, param: str, shard: Shard) -> torch.Tensor:
        return self.weight.data
