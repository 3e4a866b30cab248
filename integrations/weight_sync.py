"""Trainer side of weight sync: push a transformers model's weights into an engine, bucket by bucket.

`sync_weights(model, engine)` walks a plain, DDP-, accelerate-, torch.compile- or FSDP2-wrapped model,
names every parameter as Hugging Face does, and sends buckets of about `bucket_bytes`:

- to an in-process `Engine`: the tensors themselves (the engine copies them into its parameters);
- to an `EngineProcess`: flattened buckets shared by CUDA IPC (shared memory on a CPU), two buffers
  in turn, so packing the next bucket overlaps the engine copying the previous one;
- to a `BroadcastSender`: flattened buckets broadcast from rank 0 of a group the engine joined.

FSDP2 shards (DTensors) are gathered one parameter at a time while its bucket is packed, so the extra
memory is about one bucket. Every rank of an FSDP2 job must call `sync_weights` (the gathers are
collectives); ranks without an engine pass `engine=None`.

Per-sync host work is kept off the per-tensor path: buckets are packed in the order the engine stores
its weights (so the engine loads each as one copy), their layouts are computed once per parameter
signature, plain tensors are packed by one multi-tensor copy, and on request (`keep_buffers`) the pack
buffers of an engine are kept from one sync to the next instead of allocated anew. They are off by default:
a colocated trainer would hold them through its training step.
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from integrations.params import (  # noqa: F401  (hf_name, hf_named_parameters, unwrap_model: public here too)
    device_of,
    engine_dtype,
    gathered,
    hf_name,
    hf_named_parameters,
    is_dtensor,
    unwrap_model,
)
from integrations.verify import verify_sync
from rollout.process import ipc
from rollout.weights import broadcast as bc
from rollout.weights.bucket import FlattenedBucket, TensorMeta, empty_buffer, layout, total_bytes, view, write

DEFAULT_BUCKET_BYTES = 512 << 20
GROUP_NAME = "rollout-weights"


@dataclass
class SyncStats:
    transport: str
    tensors: int
    buckets: int
    bytes: int
    seconds: float


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    metas: list[TensorMeta]

    @property
    def nbytes(self) -> int:
        return total_bytes(self.metas)

    def tensors(self) -> Iterator[torch.Tensor]:
        """Full tensors, gathered one at a time as the caller consumes them."""
        for p in self.params:
            yield gathered(p)


def plan_buckets(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None
) -> list[_Bucket]:
    """Group parameters in order into buckets of at most `bucket_bytes` (a larger tensor goes alone),
    laid out back to back as the receiver rebuilds them."""
    specs = tuple((n, (dtype or p.dtype), tuple(p.shape)) for n, p in named)
    params = [p for _, p in named]
    return [
        _Bucket(params[start : start + len(metas)], metas) for start, metas in _layouts(specs, bucket_bytes)
    ]


@functools.lru_cache(maxsize=16)
def _layouts(
    specs: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...], bucket_bytes: int
) -> tuple[tuple[int, list[TensorMeta]], ...]:
    """(first index, metadata) of each bucket; a trainer syncs the same parameters every step, so this
    per-tensor work runs once."""
    groups: list[list[int]] = []
    size = 0
    for i, (_, dtype, shape) in enumerate(specs):
        nbytes = math.prod(shape) * dtype.itemsize
        if not groups or size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return tuple(
        (g[0], layout([specs[i][0] for i in g], [specs[i][1] for i in g], [specs[i][2] for i in g]))
        for g in groups
    )


@dataclass
class _PackBuffer:
    """A byte buffer buckets are packed into, with the views of each layout packed into it so far (both
    persist across syncs, the layouts coming from the `_layouts` cache)."""

    tensor: torch.Tensor
    slots: dict[int, tuple[list[TensorMeta], list[torch.Tensor]]] = field(default_factory=dict)

    def views(self, metas: list[TensorMeta]) -> list[torch.Tensor]:
        cached = self.slots.get(id(metas))
        if cached is None or cached[0] is not metas:  # the id of a layout the cache dropped
            cached = self.slots[id(metas)] = (metas, [view(self.tensor, m) for m in metas])
        return cached[1]


def _fill(buffer: _PackBuffer, bucket: _Bucket) -> FlattenedBucket:
    aligned = all(m.offset % m.dtype.itemsize == 0 for m in bucket.metas)  # views, not copies
    if not aligned or any(is_dtensor(p) for p in bucket.params):
        for meta, t in zip(bucket.metas, bucket.tensors()):
            write(buffer.tensor, meta, t)  # casts to the bucket's dtype; the gathered tensor is then freed
    else:  # one multi-tensor copy, casting on the way
        torch._foreach_copy_(buffer.views(bucket.metas), bucket.params)
    return FlattenedBucket(buffer.tensor[: bucket.nbytes], bucket.metas)


# -- targets: where buckets go ---------------------------------------------------------------------
# An engine's pack buffers, kept between syncs when asked (keep_buffers=True), so a sync allocates none.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def release_sync_buffers(engine: Any) -> None:
    """Free the pack buffers `sync_weights(..., keep_buffers=True)` keeps for `engine`."""
    _KEPT.pop(engine, None)
    ipc.release()


class _Direct:
    """An Engine in this process: hand it the tensors (or one flattened buffer)."""

    name = "in-process"

    def __init__(self, engine: Any, flatten: bool, abort: bool, capacity: int, keep: bool):
        self.engine, self.flatten, self.abort, self.capacity, self.keep = (
            engine,
            flatten,
            abort,
            capacity,
            keep,
        )
        self.buffers: list[_PackBuffer | None] = list(_KEPT.get(engine, [None])) if keep else [None]
        self.dtype = engine_dtype(engine)

    def send(self, bucket: _Bucket) -> None:
        if self.flatten:
            self.buffers[0] = _ensure(self.buffers[0], self.capacity, device_of(bucket.params[0]))
            self.engine.update_weights_from_tensor(
                _fill(self.buffers[0], bucket), load_format="flattened_bucket", abort=self.abort
            )
        else:
            # the engine's copy casts to its dtype, rounding as .to() does: no cast here, no temporaries
            named = [
                (m.name, t if m.dtype == self.dtype else t.to(m.dtype))
                for m, t in zip(bucket.metas, bucket.tensors())
            ]
            self.engine.update_weights_from_tensor(named, abort=self.abort)

    def finish(self) -> None:
        if self.keep:
            _KEPT[self.engine] = self.buffers
        self.buffers = [None]

    cancel = finish


class _ToProcess:
    """An EngineProcess: flattened buckets by CUDA IPC / shared memory, two buffers in turn."""

    name = "ipc"

    def __init__(self, engine: Any, abort: bool, capacity: int, keep: bool):
        self.engine, self.abort, self.capacity, self.keep = engine, abort, capacity, keep
        self.buffers: list[_PackBuffer | None] = (
            list(_KEPT.get(engine, [None, None])) if keep else [None, None]
        )
        self.pending: deque = deque()
        self.sent = 0

    def send(self, bucket: _Bucket) -> None:
        slot = self.sent % 2
        if len(self.pending) == 2:
            self.pending.popleft().result()  # the engine is done with this slot's buffer
        device = device_of(bucket.params[0])
        self.buffers[slot] = _ensure(self.buffers[slot], self.capacity, device, shared=True)
        packed = _fill(self.buffers[slot], bucket)
        self.pending.append(
            self.engine.submit("update_weights_from_tensor", packed, "flattened_bucket", abort=self.abort)
        )
        self.sent += 1

    def finish(self) -> None:
        try:
            while self.pending:
                self.pending.popleft().result()
        finally:
            self.cancel()

    def cancel(self) -> None:
        while self.pending:  # answers must be read even after a failure, to keep the pipe in step
            try:
                self.pending.popleft().result()
            except Exception:
                pass
        if self.keep:
            _KEPT[self.engine] = self.buffers
        self.buffers = [None, None]
        ipc.release()


def _ensure(
    buf: _PackBuffer | None, capacity: int, device: torch.device, shared: bool = False
) -> _PackBuffer:
    """A buffer of `capacity` bytes (the largest bucket) on `device`, reused across buckets."""
    if buf is not None and buf.tensor.numel() >= capacity and buf.tensor.device == torch.device(device):
        return buf
    return _PackBuffer(empty_buffer(capacity, device, shared=shared))


# -- broadcast: the sender owns rank 0 -------------------------------------------------------------
class BroadcastSender:
    """Rank 0 of a weights update group: broadcasts tensors or flattened buckets to engine ranks.

    The engine ranks must be told to receive each broadcast (`update_weights_from_distributed`) at the
    same time; `on_update(names=, dtypes=, shapes=, group_name=, load_format=)` does that (post an HTTP
    request, submit to an EngineProcess...) and may return an object with `.result()`, awaited after
    the broadcast so the engine's errors reach the trainer. Construct it while the engines call
    `init_weights_update_group(master_address, master_port, 1, world_size, group_name, backend)`.
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str = GROUP_NAME,
        backend: str = "nccl",
        *,
        on_update: Callable[..., Any] | None = None,
        device: torch.device | str | None = None,
        timeout: float = bc.DEFAULT_TIMEOUT_S,
        on_checksum: Callable[[list[str]], dict[str, int]] | None = None,
    ):
        # on_checksum(names) asks the engine for its weights_checksum (integrations.verify_sync)
        self.on_checksum = on_checksum
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        self.group = bc.join_group(
            master_address,
            master_port,
            0,
            world_size,
            group_name,
            backend,
            device=torch.device(device),
            timeout=timeout,
        )
        self.on_update = on_update
        self._on_close: list[Callable[[], Any]] = []
        self.buffer: _PackBuffer | None = None
        self.capacity = 0  # set by sync_weights: the largest bucket's bytes

    @property
    def group_name(self) -> str:
        return self.group.name

    @property
    def device(self) -> torch.device:
        return self.group.device

    def send_bucket(self, bucket: FlattenedBucket) -> None:
        """Broadcast one flattened buffer (the engines rebuild its layout from names/dtypes/shapes)."""
        pending = self._notify(bucket.metas, "flattened_bucket")
        bc.broadcast(bucket.buffer, self.group)
        _settle(pending)

    def send_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """One broadcast per tensor, in order (SGLang's load_format=None)."""
        tensors = [t.detach().to(self.device).contiguous() for _, t in named]
        metas = layout([n for n, _ in named], [t.dtype for t in tensors], [t.shape for t in tensors])
        pending = self._notify(metas, None)
        for t in tensors:
            bc.broadcast(t, self.group)
        _settle(pending)

    def _notify(self, metas: list[TensorMeta], load_format: str | None) -> Any:
        if self.on_update is None:
            return None
        return self.on_update(
            names=[m.name for m in metas],
            dtypes=[str(m.dtype).removeprefix("torch.") for m in metas],
            shapes=[list(m.shape) for m in metas],
            group_name=self.group.name,
            load_format=load_format,
        )

    # sync_weights target protocol
    name = "broadcast"

    def send(self, bucket: _Bucket) -> None:
        self.buffer = _ensure(self.buffer, self.capacity, self.device)
        self.send_bucket(_fill(self.buffer, bucket))

    def finish(self) -> None:
        self.buffer = None

    cancel = finish

    def close(self) -> None:
        """Leave the group (and let an attached engine leave it too)."""
        if self.group is None:
            return
        for fn in self._on_close:
            fn()
        bc.leave_group(self.group)
        self.group = None

    def __enter__(self) -> BroadcastSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @classmethod
    def for_engine(
        cls,
        engine: Any,
        backend: str = "nccl",
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str = GROUP_NAME,
        device: torch.device | str | None = None,
        timeout: float = bc.DEFAULT_TIMEOUT_S,
    ) -> BroadcastSender:
        """A sender wired to one EngineProcess: it joins the group as rank 1 and receives every send."""
        port = master_port or bc.free_port()
        joining = engine.submit(
            "init_weights_update_group", master_address, port, 1, 2, group_name, backend, timeout=timeout
        )
        try:
            sender = cls(
                master_address,
                port,
                2,
                group_name,
                backend,
                device=device,
                timeout=timeout,
                on_update=lambda **kw: engine.submit("update_weights_from_distributed", **kw),
                on_checksum=engine.weights_checksum,
            )
        except BaseException:
            _settle_quietly(joining)
            raise
        joining.result()
        sender._on_close.append(lambda: engine.destroy_weights_update_group(group_name))
        return sender


def _settle(pending: Any) -> None:
    if hasattr(pending, "result"):
        pending.result()


def _settle_quietly(pending: Any) -> None:
    try:
        _settle(pending)
    except Exception:
        pass


# -- the entry point -------------------------------------------------------------------------------
def _target_for(engine: Any, flatten: bool | None, abort: bool, capacity: int, keep: bool) -> Any:
    from rollout.process.engine_process import EngineProcess

    if engine is None:
        return None
    if isinstance(engine, BroadcastSender):
        if engine.group is None:
            raise RuntimeError("the BroadcastSender is closed")
        engine.capacity = capacity
        return engine
    if isinstance(engine, EngineProcess):
        return _ToProcess(engine, abort, capacity, keep)
    if hasattr(engine, "update_weights_from_tensor"):
        return _Direct(engine, bool(flatten), abort, capacity, keep)
    raise TypeError(
        f"engine must be an Engine, EngineProcess, BroadcastSender or None, got {type(engine).__name__}"
    )


def _engine_order(engine: Any) -> list[str] | None:
    """The HF names in the engine's storage order (Engine.weight_order, also on its process-backed
    forms), or None when it is not known (a BroadcastSender's engines)."""
    order = getattr(engine, "weight_order", None)
    return order if isinstance(order, list) else None


def in_order(
    named: list[tuple[str, torch.Tensor]], order: list[str] | None
) -> list[tuple[str, torch.Tensor]]:
    """`named` sorted as `order` lists the names; names it lacks keep their places after those it has."""
    if not order:
        return named
    rank = {name: i for i, name in enumerate(order)}
    return sorted(named, key=lambda item: rank.get(item[0], len(rank)))


@torch.no_grad()
def sync_weights(
    model: nn.Module,
    engine: Any,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | str | None = "auto",
    flatten: bool | None = None,
    abort: bool = False,
    verify: bool = False,
    engine_order: bool = True,
    keep_buffers: bool = False,
) -> SyncStats:
    """Copy every parameter of `model` into `engine` (Engine, EngineProcess, BroadcastSender, or None
    on ranks that only take part in FSDP2 gathers).

    dtype: what the tensors travel as; "auto" is the engine's dtype when it is known (so a float32
    master copy crosses as bfloat16), None keeps the trainer's. flatten: for an in-process Engine,
    pack flattened buckets instead of handing over the tensors (other targets always flatten).
    abort: abort requests in flight in the engine instead of refusing the update.
    verify: then compare checksums of every tensor on both sides (integrations.verify_sync), raising
    WeightMismatchError naming the first that differs.
    engine_order: pack buckets in the order the engine stores its weights, when it says (an Engine or
    EngineProcess): a bucket in the engine's dtype then loads as one copy.
    keep_buffers: keep the pack buffers (two for an EngineProcess, one for flatten=True) for the next
    sync, at the cost of holding them in between; `release_sync_buffers(engine)` frees them.
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    if dtype == "auto":
        dtype = engine_dtype(engine)
    elif dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, 'auto' or None, got {dtype!r}")
    t0 = time.perf_counter()
    named = hf_named_parameters(model)
    if engine_order:
        named = in_order(named, _engine_order(engine))
    buckets = plan_buckets(named, bucket_bytes, dtype)
    capacity = max((b.nbytes for b in buckets), default=0)
    target = _target_for(engine, flatten, abort, capacity, keep_buffers)
    if target is None:
        for b in buckets:  # take part in the gathers, send nothing
            if any(is_dtensor(p) for p in b.params):
                for _ in b.tensors():
                    pass
        if verify:
            _verify(model, None, dtype)
        return SyncStats("none", len(named), 0, 0, time.perf_counter() - t0)
    try:
        for b in buckets:
            target.send(b)
        target.finish()
    except BaseException:
        target.cancel()
        raise
    _sync_device(named)
    if verify:
        _verify(model, engine, dtype)
    return SyncStats(
        target.name, len(named), len(buckets), sum(b.nbytes for b in buckets), time.perf_counter() - t0
    )


def _verify(model: nn.Module, engine: Any, dtype: torch.dtype | None) -> None:
    verify_sync(model, engine, dtype=dtype)


def _sync_device(named: list[tuple[str, torch.Tensor]]) -> None:
    """Timing honesty for in-process copies: wait for the queued GPU work."""
    if named and torch.cuda.is_available():
        device = device_of(named[0][1])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
