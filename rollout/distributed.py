"""Tensor-parallel groups of one engine: rank, size, collectives, and how they are formed.

An engine inside a torchrun job shares the trainer's world. With `tp_size=k` the world is cut into
groups of k consecutive ranks (each group one engine, the groups data-parallel), or the caller hands
in its own group (a ProcessGroup or a 1-D DeviceMesh). The trainer's default group is never touched:
we only add groups, with our own backend (gloo on a CPU, nccl on a GPU) and timeout.

SPMD contract: every rank of a group makes the same engine calls with the same arguments (generate,
weight updates, get_weights_by_name, flush_cache, release/resume). The group checks generate's inputs
(see `agreement`); a rank that fails elsewhere makes the others fail at their next collective, after
the group's timeout, with a `CollectiveError` instead of hanging.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch


class CollectiveError(RuntimeError):
    """A collective of a tensor-parallel group failed: a peer raised, exited, diverged or timed out."""


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0  # rank inside the group
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup when size > 1
    ranks: tuple[int, ...] = (0,)  # global ranks of the group, in group-rank order
    device: str = "cpu"  # where the group's tensors live (nccl needs them on the GPU)
    timeout_s: float | None = None  # None: the group was given to us with its own timeout

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist

            with self._guard("all_reduce"):
                dist.all_reduce(x, op=getattr(dist.ReduceOp, op.upper()), group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        with self._guard("all_gather"):
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def shard(self, full: int, what: str) -> int:
        if full % self.size:
            raise ValueError(f"tp_size={self.size} does not divide {what}={full}")
        return full // self.size

    def min_int(self, value: int) -> int:
        """The smallest `value` over the group (so sizes computed from free memory agree)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, op="min").item())

    @contextmanager
    def _guard(self, op: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as e:  # gloo/nccl timeouts and closed connections (DistBackendError too)
            wait = f"{self.timeout_s:g}s" if self.timeout_s is not None else "the group's"
            raise CollectiveError(
                f"tensor-parallel {op} failed on global rank {self.ranks[self.rank]} (group ranks "
                f"{list(self.ranks)}): another rank of the group raised, exited or made different calls, "
                f"and {wait} timeout passed or its connection closed. Check the other ranks' errors; "
                f"this engine's group is unusable now. Cause: {e}"
            ) from e


SINGLE = TPGroup()


# -- forming groups --------------------------------------------------------------------------------
def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def check_model_split(tp_size: int, sizes: dict[str, int]) -> None:
    """Raise a ValueError naming the first model size that `tp_size` does not divide."""
    for name, value in sizes.items():
        if value % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide {name}={value}")


def make_tp_group(
    tp_size: int,
    tp_group: Any,
    *,
    device: torch.device,
    timeout_s: float,
    model_sizes: dict[str, int],
) -> TPGroup:
    """The engine's group: from `tp_group` when given, else consecutive ranks of the default world.

    Every check that can fail runs before any collective and gives the same answer on every rank,
    so a bad setting raises a ValueError everywhere instead of leaving some ranks waiting.
    """
    if isinstance(tp_group, TPGroup):
        check_model_split(tp_group.size, model_sizes)
        return tp_group
    if tp_group is not None:
        group = _as_process_group(tp_group)
        return _connect(_wrap_given(group, tp_size, device, model_sizes))
    if tp_size == 1:
        return TPGroup(ranks=(_global_rank(),), device=str(device))
    dist = _require_dist(f"tp_size={tp_size}")
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the world size {world} of torch.distributed")
    check_model_split(tp_size, model_sizes)
    backend, me = backend_for(device), dist.get_rank()
    mine = None
    # new_group is collective over the whole world: every rank creates every group, in the same order
    for start in range(0, world, tp_size):
        ranks = tuple(range(start, start + tp_size))
        group = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s), backend=backend)
        if me in ranks:
            mine = TPGroup(ranks.index(me), tp_size, group, ranks, str(device), timeout_s)
    return _connect(mine)


def _connect(tp: TPGroup) -> TPGroup:
    """One collective right away: a missing peer shows at construction, and NCCL sets up its
    communicator now rather than inside a memory-saver region (whose memory is freed on release)."""
    tp.all_reduce(torch.zeros(1, device=tp.device))
    return tp


def _wrap_given(group: Any, tp_size: int, device: torch.device, model_sizes: dict[str, int]) -> TPGroup:
    dist = _require_dist("tp_group")
    size = group.size()
    if tp_size not in (1, size):
        raise ValueError(f"tp_size={tp_size} disagrees with the size {size} of the given tp_group")
    check_model_split(size, model_sizes)
    backend = str(dist.get_backend(group))
    if backend_for(device) not in backend:
        raise ValueError(
            f"tp_group uses backend {backend!r} but the engine runs on {device}; "
            f"a {device.type} engine needs a {backend_for(device)} group"
        )
    ranks = tuple(dist.get_process_group_ranks(group))
    return TPGroup(ranks.index(dist.get_rank()), size, group, ranks, str(device), None)


def _as_process_group(tp_group: Any) -> Any:
    dist = _require_dist("tp_group")
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(tp_group, DeviceMesh):
        if tp_group.ndim != 1:
            raise ValueError(
                f"tp_group: pass a 1-D DeviceMesh (e.g. mesh['tp']), got dims {tp_group.mesh_dim_names}"
            )
        return tp_group.get_group()
    if not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(
            f"tp_group must be a ProcessGroup, a 1-D DeviceMesh or a TPGroup, got {type(tp_group).__name__}"
        )
    if dist.get_rank() not in dist.get_process_group_ranks(tp_group):
        raise ValueError("tp_group: this rank is not a member of the given group")
    return tp_group


def _require_dist(what: str) -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{what} needs torch.distributed initialised (run under torchrun and call "
            f"init_process_group before building the engine)"
        )
    return dist


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# -- agreeing on inputs ------------------------------------------------------------------------------
MAX_PARTS = 4  # the exchange has a fixed size, so a rank that failed early still matches the others


class Agreement:
    """Collects what this rank is about to do; the group compares digests when the block ends."""

    def __init__(self) -> None:
        self.parts: dict[str, Any] = {}

    def propose(self, **parts: Any) -> None:
        """Named values every rank must agree on (compared by a 64-bit digest of their repr)."""
        if len(parts) > MAX_PARTS:
            raise ValueError(f"at most {MAX_PARTS} parts can be agreed on at once")
        self.parts = parts

    def digests(self) -> list[int]:
        return [
            int.from_bytes(hashlib.sha256(repr(v).encode()).digest()[:8], "little", signed=True)
            for v in self.parts.values()
        ]


@contextmanager
def agreement(tp: TPGroup, what: str) -> Iterator[Agreement]:
    """Run a block (checks, normalisation) on every rank, then make the group agree on its outcome.

    If the block raised on any rank, every rank raises (the failing ones their own error, the others a
    RuntimeError naming them); if a proposed value differs, every rank raises the same ValueError.
    So bad or diverging inputs never leave part of the group waiting inside a forward pass. Every rank
    must propose the same names.
    """
    box = Agreement()
    if tp.size == 1:
        yield box  # nothing to agree with (and nothing hashed)
        return
    try:
        yield box
    except BaseException:
        try:
            _exchange(tp, None)
        except CollectiveError:
            pass  # the peers will time out too; our own error is the useful one
        raise
    rows = _exchange(tp, box.digests())
    failed = [i for i, r in enumerate(rows) if r is None]
    if failed:
        raise RuntimeError(f"{what} raised on tensor-parallel rank(s) {failed} of group {list(tp.ranks)}")
    differ = [i for i, r in enumerate(rows) if r != rows[0]]
    if differ:
        names = [n for k, n in enumerate(box.parts) if any(r[k] != rows[0][k] for r in rows)]
        raise ValueError(
            f"{what}: the {' and '.join(names)} differ between the ranks of one tensor-parallel group "
            f"(ranks {differ} differ from rank 0 of group {list(tp.ranks)}). Every rank of a group must "
            f"make the same engine calls (generate, flush_cache, weight updates, release/resume) with the "
            f"same arguments; give each data-parallel group its own prompts "
            f"(integrations.torchrun.DataParallelRollout)"
        )


def _exchange(tp: TPGroup, digests: list[int] | None) -> list[list[int] | None]:
    """Every rank's digests (None where the rank failed), through one small all_gather."""
    row = torch.zeros(1 + MAX_PARTS, dtype=torch.int64)
    if digests is not None:
        row[0] = 1
        row[1 : 1 + len(digests)] = torch.tensor(digests, dtype=torch.int64)
    rows = tp.all_gather(row.to(tp.device).unsqueeze(0), dim=0).cpu().tolist()
    return [r[1:] if r[0] else None for r in rows]
