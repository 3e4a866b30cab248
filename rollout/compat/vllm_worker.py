"""The worker behind the vLLM front's `collective_rpc`, and its extension hook.

vLLM runs a worker per GPU and reaches it by name: `llm.collective_rpc("reload_weights")`, or a method
that `LLM(worker_extension_cls="pkg.mod.Class")` mixes into the worker class (OpenRLHF's `WorkerWrap`,
TRL's and verl's weight-sync extensions). Here one process holds one engine (one rank of a TP group),
so there is one worker: `collective_rpc` calls the method on it and answers a list of one result.

The worker offers what extension methods read: `self.model_runner.model.load_weights(weights)` (HF
names, validated whole by the engine), `self.device`, `self.model_config.dtype`, `self.rank`, and
`self.engine` (the `rollout.Engine`). It also has vLLM's `reload_weights` (read the checkpoint folder
again: level-2 sleep's idiom) and OpenRLHF's weight-sync methods, built in:

- `init_process_group(master_address, master_port, rank_offset, world_size, group_name,
  backend="nccl", use_ray=False)`: join the trainer's broadcast group as rank `rank_offset` (+ TP rank).
  The trainer creates the group with torch's TCP rendezvous, as for an SGLang engine (OpenRLHF's
  SGLang path, verl, slime); vLLM's StatelessProcessGroup/PyNccl rendezvous and Ray collectives
  (`use_ray=True`) are not spoken here.
- `update_weight(name, dtype, shape, empty_cache=False)`: receive one broadcast tensor and load it.
- `update_weight_cuda_ipc(name, dtype, shape, ipc_handles=None, empty_cache=False)`: rebuild the tensor
  from `torch.multiprocessing.reductions.reduce_tensor`'s handle (keyed by the GPU's UUID; a CUDA
  handle is pointed at this engine's device) and load it.

Since these are built in, OpenRLHF's own `WorkerWrap` path is not imported (it reaches into vLLM's
internals). Any other `worker_extension_cls` is imported and mixed in; a method name the worker already
has is refused, as vLLM refuses it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from rollout.engine.engine import Engine
from rollout.weights.bucket import parse_dtype

# extension classes whose methods the worker has built in (they would reach into vLLM itself)
BUILT_IN_EXTENSIONS = frozenset({"openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"})
GROUP = "vllm_worker_group"  # the engine-side name of the group init_process_group joins


class _Namespace:
    def __init__(self, **kw: Any):
        self.__dict__.update(kw)


class _Model:
    """`model_runner.model`: `load_weights` as vLLM models take it (an iterable of (name, tensor))."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        named = list(weights)
        self._engine.update_weights_from_tensor(named)
        return {name for name, _ in named}


class Worker:
    """One engine's worker (see the module)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.device = engine.device
        self.rank = engine.tp.rank
        self.model_config = _Namespace(dtype=engine.dtype, max_model_len=engine.max_model_len)
        self.model_runner = _Namespace(model=_Model(engine))
        self._group: str | None = None

    def reload_weights(self) -> None:
        """vLLM's: read the weights from the checkpoint folder again (after wake_up(["weights"]))."""
        self.engine.update_weights_from_disk(self.engine.config.model)

    def init_process_group(
        self,
        master_address: str,
        master_port: int | str,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        use_ray: bool = False,
    ) -> None:
        if use_ray:
            raise ValueError("init_process_group: use_ray=True (Ray collectives) is unsupported here")
        if self._group is not None:
            raise ValueError(f"init_process_group: already in group {self._group!r}")
        self.engine.init_weights_update_group(
            master_address, int(master_port), rank_offset, world_size, group_name, backend
        )
        self._group = group_name

    def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False) -> None:
        if self._group is None:
            raise ValueError("update_weight: call init_process_group first")
        self.engine.update_weights_from_distributed([name], [parse_dtype(dtype)], [list(shape)], self._group)
        _maybe_empty_cache(empty_cache)

    def update_weight_cuda_ipc(
        self, name: str, dtype: Any, shape: Any, ipc_handles: dict | None = None, empty_cache: bool = False
    ) -> None:
        func, args = self._handle(ipc_handles)
        args = list(args)
        if func is _rebuild_cuda_tensor():  # the handle names the sender's device: open it on ours
            args[6] = self.device.index if self.device.index is not None else torch.cuda.current_device()
        weight = func(*args)
        if tuple(weight.shape) != tuple(shape):
            raise ValueError(
                f"update_weight_cuda_ipc: {name!r} arrived as {tuple(weight.shape)}, not {tuple(shape)}"
            )
        self.engine.update_weights_from_tensor([(name, weight.to(parse_dtype(dtype)))])
        _maybe_empty_cache(empty_cache)

    def _handle(self, ipc_handles: dict | None) -> tuple[Callable, tuple]:
        if not isinstance(ipc_handles, dict) or not ipc_handles:
            raise ValueError("update_weight_cuda_ipc: ipc_handles must be a dict {gpu uuid: handle}")
        if self.device.type == "cuda":
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            if uuid in ipc_handles:
                return ipc_handles[uuid]
        if len(ipc_handles) == 1:  # one sender, one engine: its handle is ours
            return next(iter(ipc_handles.values()))
        raise ValueError(
            f"update_weight_cuda_ipc: no handle for this engine's device among {list(ipc_handles)}"
        )


def worker_class(extension: str | type | None) -> type[Worker]:
    """The worker class with `extension` mixed in (vLLM's worker_extension_cls)."""
    if not extension or (isinstance(extension, str) and extension in BUILT_IN_EXTENSIONS):
        return Worker
    cls = _import(extension) if isinstance(extension, str) else extension
    if not isinstance(cls, type):
        raise TypeError(f"worker_extension_cls must be a class or 'module.Class', got {extension!r}")
    clash = sorted(n for n in vars(cls) if not n.startswith("__") and hasattr(Worker, n))
    if clash:
        raise ValueError(f"worker_extension_cls {cls.__name__}: the worker already has {clash}")
    return type(f"Worker+{cls.__name__}", (Worker, cls), {})


def call(worker: Worker, method: str | Callable, args: tuple, kwargs: dict | None) -> Any:
    """collective_rpc on this engine's one worker: a method name, or a callable taking the worker."""
    if callable(method):
        return method(worker, *args, **(kwargs or {}))
    if not isinstance(method, str) or method.startswith("_") or not callable(getattr(worker, method, None)):
        raise AttributeError(f"collective_rpc: the worker has no method {method!r}")
    return getattr(worker, method)(*args, **(kwargs or {}))


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"worker_extension_cls {path!r} cannot be imported: {e}") from None


def _rebuild_cuda_tensor() -> Callable:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor


def _maybe_empty_cache(empty_cache: bool) -> None:
    if empty_cache and torch.cuda.is_available():
        torch.cuda.empty_cache()
