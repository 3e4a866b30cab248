"""Tensors as handles another process opens: CUDA IPC on a GPU, shared memory on a CPU.

The tensor's bytes are never pickled. A CUDA handle names the sender's allocation (the receiver maps
it); a CPU tensor lives in shared memory and its file descriptor crosses the multiprocessing pipe
(torch's reductions, registered with multiprocessing's ForkingPickler, which the pipe uses).

Lifetimes: the receiver must drop the tensors it opened before acknowledging; the sender keeps its
tensors alive until then, and afterwards calls `release()` so torch frees CUDA blocks whose
receivers are done (`torch.cuda.ipc_collect`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
from torch.multiprocessing.reductions import reduce_tensor

from rollout.weights.bucket import FlattenedBucket


@dataclass
class TensorHandle:
    """What crosses the process boundary in place of a tensor."""

    rebuild: Callable[..., torch.Tensor]
    args: tuple
    device_type: str
    nbytes: int

    def open(self) -> torch.Tensor:
        return self.rebuild(*self.args)


def share(t: torch.Tensor) -> TensorHandle:
    """A handle to `t` (CPU tensors not already in shared memory are copied there first)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    if t.device.type == "cpu":
        if not t.is_shared():
            t = t.clone().share_memory_()
    elif t.device.type != "cuda":
        raise ValueError(f"cannot share a tensor on {t.device} with another process")
    rebuild, args = reduce_tensor(t)
    return TensorHandle(rebuild, args, t.device.type, t.numel() * t.element_size())


def ready_for_peer(devices: set[torch.device]) -> None:
    """Wait for the work queued on these devices' current streams (e.g. packing a buffer): a receiver
    that reopens a cached handle does not wait on the sender's stream by itself."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


def release() -> None:
    """Let torch free CUDA blocks the sender no longer holds and whose receivers are done."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


# -- whole argument lists ------------------------------------------------------------------------
def to_handles(obj: Any, devices: set[torch.device]) -> Any:
    """Replace every tensor inside lists, tuples, dicts and flattened buckets by a handle."""
    if isinstance(obj, torch.Tensor):
        devices.add(obj.device)
        return share(obj)
    return _map(obj, lambda x: to_handles(x, devices))


def open_handles(obj: Any) -> Any:
    if isinstance(obj, TensorHandle):
        return obj.open()
    return _map(obj, open_handles)


def _map(obj: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(obj, list):
        return [fn(x) for x in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(fn(x) for x in obj)
    if isinstance(obj, dict):
        return {k: fn(v) for k, v in obj.items()}
    if isinstance(obj, FlattenedBucket):
        return FlattenedBucket(fn(obj.buffer), obj.metas)
    return obj
