"""Per-request state beside the paged KV cache, for models that carry one (linear attention).

A recurrent layer keeps a fixed-size state per request instead of a KV entry per token. A model that has
such layers declares it (`state_shapes`: name -> (per-layer, per-request shape, dtype)); the engine then
makes a StatePool of `max_running_requests` slots (+ one scratch slot that CUDA-graph padding rows
write to), sized together with the KV pages and released/resumed with them (the `kv_cache` tag).

Which request holds which slot, and the snapshots of shared prompts, are the runner's
(runner/state_slots.py); docs/architecture.md, "Per-request state".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

StateShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> ((layers, *per request), dtype)


class StatePool:
    def __init__(self, shapes: StateShapes, num_slots: int, device: torch.device):
        self.shapes, self.num_slots, self.device = dict(shapes), num_slots, device
        self.scratch_slot = num_slots
        self.tensors: dict[str, torch.Tensor] | None = None
        self.allocate()

    @staticmethod
    def bytes_per_slot(shapes: StateShapes) -> int:
        return sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in shapes.values())

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot(self.shapes) * (self.num_slots + 1)

    def allocate(self) -> None:
        # [layer, slot, ...]: one layer's states of every slot are one contiguous tensor
        self.tensors = {
            name: torch.zeros((shape[0], self.num_slots + 1, *shape[1:]), dtype=dtype, device=self.device)
            for name, (shape, dtype) in self.shapes.items()
        }

    def free(self) -> None:
        self.tensors = None

    def zero(self) -> None:
        for t in self.tensors.values():
            t.zero_()

    def layer(self, name: str, layer: int) -> torch.Tensor:
        """[slots + 1, *per request] of one layer."""
        return self.tensors[name][layer]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots dst[i] := slots src[i] (int64 device tensors), every layer and tensor."""
        for t in self.tensors.values():
            t[:, dst] = t[:, src]


@dataclass
class StateBatch:
    """A step's view of the state pool: request b of the batch uses slot slots[b]; fresh[b] means its
    chunk starts at token 0 (a zero state, whatever the slot holds)."""

    pool: StatePool
    slots: torch.Tensor  # int64 [B]
    fresh: torch.Tensor  # bool [B]
    q_lens: list[int]
    cu_seqlens: torch.Tensor  # int32 [B + 1]
    decode: bool
