"""A process group of its own for weight broadcasts, beside whatever groups the process already has.

Members meet by TCP rendezvous at master_address:master_port (rank 0 hosts the store) under a store
prefixed by the group name: the `init_custom_process_group` pattern of OpenRLHF, slime and AReaL, so a
trainer that joins that way talks to this engine unchanged. The default group (torchrun's) is neither
created nor touched. Every wait is bounded by `timeout`: a peer that never comes is a TimeoutError.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollout.weights.bucket import FlattenedBucket, TensorMeta, empty_buffer, layout, total_bytes

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class UpdateGroup:
    name: str
    pg: Any  # torch.distributed ProcessGroup
    rank: int
    world_size: int
    backend: str
    device: torch.device  # where broadcast tensors are received


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_backend(backend: str, device: torch.device) -> torch.device:
    """The device broadcasts use for this backend: NCCL needs a CUDA device, gloo works on the CPU."""
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError(f"backend='nccl' needs a CUDA device, this side is on {device}; use 'gloo'")
        return device
    if backend == "gloo":
        return torch.device("cpu")
    raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    *,
    device: torch.device,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> UpdateGroup:
    """Join (rank 0: host) the group; returns once every member has joined, or raises TimeoutError."""
    _check_args(master_address, master_port, rank, world_size, group_name, timeout)
    recv_device = check_backend(backend, device)
    td = timedelta(seconds=timeout)
    where = f"weights update group {group_name!r} (rank {rank} of {world_size}, tcp://{master_address}:{master_port})"
    try:
        # Our own TCPStore rather than dist.rendezvous: under torchrun, rendezvous would reuse the
        # elastic agent's store and no one would host this one. Rank 0 waits for every member.
        store = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=td,
            wait_for_workers=True,
            multi_tenant=True,
        )
        store.set_timeout(td)
        cuda = torch.cuda.device(device) if backend == "nccl" else contextlib.nullcontext()
        with cuda, _no_split_from_default_group():
            pg, _ = dist.distributed_c10d._new_process_group_helper(
                world_size,
                rank,
                [],
                dist.Backend(backend),
                dist.PrefixStore(group_name, store),
                group_name=group_name,
                timeout=td,
            )
    except RuntimeError as e:  # DistStoreError, DistNetworkError
        if _is_timeout(e):
            raise TimeoutError(f"{where}: peers did not all join within {timeout:g}s ({e})") from e
        raise RuntimeError(f"{where}: could not be created: {e}") from e
    dist.distributed_c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return UpdateGroup(group_name, pg, rank, world_size, backend, recv_device)


def leave_group(group: UpdateGroup) -> None:
    dist.destroy_process_group(group.pg)


def _check_args(address: str, port: int, rank: int, world_size: int, name: str, timeout: float) -> None:
    if not isinstance(address, str) or not address:
        raise ValueError(f"master_address must be a host name or IP, got {address!r}")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"master_port must be an int in 1..65535, got {port!r}")
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(
            f"world_size must be an int >= 2 (the sender plus the engine ranks), got {world_size!r}"
        )
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank!r} is outside the group of {world_size}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"group_name must be a non-empty str, got {name!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text or type(e).__name__ == "DistStoreError"


@contextlib.contextmanager
def _no_split_from_default_group() -> Iterator[None]:
    """When the default group is bound to a device, torch would build an NCCL group by splitting the
    default communicator, a collective over ranks that are not in this group: hide the binding."""
    default = dist.distributed_c10d._world.default_pg if dist.is_initialized() else None
    bound = getattr(default, "bound_device_id", None)
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


# -- moving tensors ------------------------------------------------------------------------------
def broadcast(tensor: torch.Tensor, group: UpdateGroup) -> None:
    """Broadcast from rank 0 of the group (in place on the other ranks)."""
    try:
        dist.broadcast(tensor, group=group.pg, group_src=0)
    except RuntimeError as e:
        if _is_timeout(e):
            raise TimeoutError(f"weights update group {group.name!r}: broadcast timed out ({e})") from e
        raise


def receive_tensors(
    group: UpdateGroup, names: Sequence[str], dtypes: Sequence[Any], shapes: Sequence[Any]
) -> list[tuple[str, torch.Tensor]]:
    """One broadcast per tensor, in the order of `names`, into fresh buffers."""
    metas = layout(names, dtypes, shapes)
    tensors = [torch.empty(m.shape, dtype=m.dtype, device=group.device) for m in metas]
    for t in tensors:
        broadcast(t, group)
    return [(m.name, t) for m, t in zip(metas, tensors)]


def receive_bucket(
    group: UpdateGroup, names: Sequence[str], dtypes: Sequence[Any], shapes: Sequence[Any]
) -> FlattenedBucket:
    """One broadcast of the whole flattened buffer (layout rebuilt from names, dtypes, shapes)."""
    metas: list[TensorMeta] = layout(names, dtypes, shapes)
    buffer = empty_buffer(total_bytes(metas), group.device)
    broadcast(buffer, group)
    return FlattenedBucket(buffer, metas)
