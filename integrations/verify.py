"""Catch silent weight-sync failures: compare the trainer's weights with the engine's by checksum.

`verify_sync(model, engine)` checksums every parameter of the trainer's model (gathered one tensor at a
time under FSDP2, cast to the dtype the sync sent) with rollout's own checksum (weights/checksum.py),
asks the engine for the same names' checksums (in process, across an EngineProcess's pipe, or through a
BroadcastSender's `on_checksum`), and raises WeightMismatchError naming the first tensor that differs.
Every rank of an FSDP2 job must call it (the gathers are collectives); ranks without an engine pass
`engine=None` and only take part in the gathers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from integrations.params import engine_dtype, gathered, hf_named_parameters
from rollout.weights.checksum import checksum_device, to_host


class WeightMismatchError(RuntimeError):
    """The engine's weights are not the trainer's (`name` is the first tensor that differs)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


@torch.no_grad()
def trainer_checksums(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Per HF name, the checksum of the trainer's parameter as the sync sends it (cast to `dtype`)."""
    sums = {}
    for name, p in hf_named_parameters(model):
        full = gathered(p)  # a collective for a DTensor: every rank runs this loop in the same order
        # a 0-dim device tensor: the full weight can go, and the host reads all sums in one copy
        sums[name] = checksum_device(full if dtype is None else full.to(dtype))
        del full
    return dict(zip(sums, to_host(list(sums.values()))))


def engine_checksums(engine: Any, names: list[str]) -> dict[str, int]:
    """The engine's checksums of `names`, computed where the engine runs."""
    if hasattr(engine, "on_checksum"):  # a BroadcastSender: its engines answer through the callable
        if engine.on_checksum is None:
            raise ValueError(
                "verify: this BroadcastSender has no on_checksum (a callable names -> "
                "{name: checksum} asking the engine's weights_checksum); BroadcastSender.for_engine sets it"
            )
        return engine.on_checksum(names)
    if hasattr(engine, "weights_checksum"):  # an Engine, or an EngineProcess forwarding the call
        return engine.weights_checksum(names)
    raise TypeError(
        f"engine must be an Engine, EngineProcess, BroadcastSender or None, got {type(engine).__name__}"
    )


def verify_sync(model: nn.Module, engine: Any, *, dtype: torch.dtype | str | None = "auto") -> int:
    """Raise WeightMismatchError unless every parameter of `model` equals the engine's, bit for bit,
    after the cast the sync made (`dtype` as in sync_weights). Returns the tensors compared."""
    if dtype == "auto":
        dtype = engine_dtype(engine)
    elif dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, 'auto' or None, got {dtype!r}")
    mine = trainer_checksums(model, dtype)
    if engine is None:
        return len(mine)
    theirs = engine_checksums(engine, list(mine))
    for name, value in mine.items():
        if theirs.get(name) != value:
            raise WeightMismatchError(
                name,
                f"weight sync check failed: {name!r} differs between the trainer and the engine "
                f"(checksum {value:#018x} vs {theirs.get(name, 0):#018x})",
            )
    return len(mine)


__all__ = ["WeightMismatchError", "engine_checksums", "trainer_checksums", "verify_sync"]
