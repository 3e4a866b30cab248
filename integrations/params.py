"""The trainer's model as the engine names it: unwrapping wrappers, Hugging Face names, full tensors.

Shared by weight_sync (sending) and verify (checking); imports neither.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

WRAPPER_TOKENS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


# -- walking the trainer's model -------------------------------------------------------------------
def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / DataParallel / torch.compile wrappers (FSDP2 wraps in place)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            break
    if type(model).__name__ == "FullyShardedDataParallel":
        raise TypeError(
            "FSDP1 models are not supported: wrap with FSDP2 (torch.distributed.fsdp.fully_shard) or pass "
            "a model holding the full parameters"
        )
    return model


def hf_name(name: str) -> str:
    for token in WRAPPER_TOKENS:
        name = name.replace(token, "")
    return name


def hf_named_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(Hugging Face name, parameter) pairs; FSDP2 parameters stay sharded DTensors."""
    return [(hf_name(n), p) for n, p in unwrap_model(model).named_parameters()]


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def device_of(p: torch.Tensor) -> torch.device:
    return p.to_local().device if is_dtensor(p) else p.device


def gathered(p: torch.Tensor) -> torch.Tensor:
    """The full tensor: gathered across ranks for a DTensor (a collective), else the local tensor."""
    return p.full_tensor() if is_dtensor(p) else p.detach()


def engine_dtype(engine: Any) -> torch.dtype | None:
    """The dtype an engine holds its weights in (an Engine's, or an EngineProcess's start-up info)."""
    dtype = getattr(engine, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    info = getattr(engine, "info", None)
    if isinstance(info, dict) and "dtype" in info:
        return getattr(torch, info["dtype"].removeprefix("torch."))
    return None
