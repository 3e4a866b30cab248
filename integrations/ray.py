"""Rollout engines as Ray actors: one `Engine` per actor, a group of them behind one generate call.

`RolloutActor` is a Ray actor class whose methods are generated from rollout/api.py's list with
Engine's signatures (as EngineProcess does), so a method added to the engine appears here too;
properties are read with `get(name)`. `RolloutGroup(n, model, **options)` places n actors (one
placement-group bundle each), splits a batch across them by prompt, broadcasts a trainer's weights
to all of them in one group, and applies release/resume to all. See docs/ray.md.

Needs the optional `ray` extra (pip install rollout-engine[ray]).
"""

from __future__ import annotations

import inspect
import os
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from integrations.weight_sync import DEFAULT_BUCKET_BYTES, BroadcastSender, SyncStats, sync_weights
from rollout.api import ENGINE_METHODS, ENGINE_PROPERTIES
from rollout.engine.engine import Engine
from rollout.outputs import RequestOutput
from rollout.sampling import SamplingParams
from rollout.weights.broadcast import DEFAULT_TIMEOUT_S, free_port

__all__ = ["EngineActor", "RolloutActor", "RolloutGroup"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
PING_TIMEOUT_S = 30.0


# -- the actor --------------------------------------------------------------------------------------
class EngineActor:
    """The body of `RolloutActor`: an engine in the actor's process, its API as actor methods.

    `engine_class` builds the engine (Engine by default; any class with Engine's methods fits, such as
    an AsyncEngine with synchronous methods). With no `device` option and no GPU assigned by Ray, the
    engine runs on the CPU, so a CPU actor on a GPU node never takes a GPU Ray did not give it.
    """

    # the methods of rollout.api are attached below the class

    def __init__(self, model: str, *, engine_class: Callable[..., Any] = Engine, **options: Any):
        if options.get("tp_size", 1) != 1:
            raise ValueError(
                "tp_size > 1 needs one process per tensor-parallel rank (torchrun); a RolloutActor holds "
                "one engine rank: run tp_size=1 actors, one per GPU"
            )
        if options.get("device") is None and not ray.get_gpu_ids():
            options["device"] = "cpu"
        self.engine = engine_class(model, **options)

    def get(self, name: str) -> Any:
        """One of the engine's read-only facts (rollout.api.ENGINE_PROPERTIES), e.g. "weight_version"."""
        if name not in ENGINE_PROPERTIES:
            raise AttributeError(
                f"{name!r} is not a property of the engine API ({', '.join(ENGINE_PROPERTIES)})"
            )
        return getattr(self.engine, name)

    def info(self) -> dict[str, Any]:
        """Where the engine runs: device, dtype, node address, pid, and the GPUs Ray assigned."""
        return {
            "device": str(self.engine.device),
            "dtype": str(self.engine.dtype).removeprefix("torch."),
            "node": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }


def _forward(name: str) -> Callable[..., Any]:
    def method(self: EngineActor, *args: Any, **kwargs: Any) -> Any:
        return _to_cpu(getattr(self.engine, name)(*args, **kwargs))

    engine_method = getattr(Engine, name)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = engine_method.__doc__
    method.__signature__ = inspect.signature(engine_method)  # type: ignore[attr-defined]
    return method


def _to_cpu(value: Any) -> Any:
    """Results leave as CPU tensors: a CUDA tensor would make the caller deserialise onto a GPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return value


for _name in ENGINE_METHODS:
    setattr(EngineActor, _name, _forward(_name))

# Ray checks each call's arguments against these signatures (they are Engine's)
RolloutActor = ray.remote(EngineActor)


# -- the group --------------------------------------------------------------------------------------
class _Pending:
    """The actors' answers to one broadcast, awaited by BroadcastSender after it has sent."""

    def __init__(self, group: RolloutGroup, refs: dict[int, Any]):
        self.group, self.refs = group, refs

    def result(self) -> list[Any]:
        return self.group._gather(self.refs)


class RolloutGroup:
    """n RolloutActors, each in its own bundle of one placement group, used as one engine.

    num_gpus / num_cpus: each actor's (and its bundle's) resources; strategy: how bundles spread over
    nodes (PACK: as few nodes as possible, SPREAD: across nodes). Other options go to every Engine.

    An actor that dies is named in the error of the call that found it (`RuntimeError("rollout actor
    1 of 2 died: ...")`) and dropped: later calls run on the survivors (`remove_dead()` checks ahead
    of time). A group object is used from one process at a time: the one that syncs weights is rank 0
    of the broadcast group (it may be a trainer actor the group was handed to).
    """

    def __init__(
        self,
        n: int,
        model: str,
        *,
        num_gpus: float = 0,
        num_cpus: float = 1,
        strategy: str = "PACK",
        runtime_env: dict | None = None,
        ready_timeout: float = 600.0,
        **options: Any,
    ):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.n, self.model = n, str(model)
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
        self.pg = placement_group([bundle] * n, strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=ready_timeout)
        except GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"{n} bundles of {bundle} ({strategy}) could not be placed within {ready_timeout:g}s: "
                f"the cluster has {ray.available_resources()}"
            ) from None
        self.actors = [self._start(i, num_cpus, num_gpus, runtime_env, options) for i in range(n)]
        self.alive = list(range(n))  # indices into self.actors, in order
        self._sender: BroadcastSender | None = None
        self._sender_members: list[int] = []
        self._abort = False
        # the engines load now; a start-up error (bad path or option) is raised here
        self.infos = self._gather({i: a.info.remote() for i, a in enumerate(self.actors)})

    def _start(self, i: int, num_cpus: float, num_gpus: float, runtime_env: Any, options: dict) -> Any:
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
        return RolloutActor.options(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            scheduling_strategy=strategy,
            runtime_env=runtime_env,
            max_restarts=0,  # a restarted engine would have lost its weights and broadcast group
        ).remote(self.model, **options)

    # -- calls ------------------------------------------------------------------------------------
    def _gather(self, refs: dict[int, Any]) -> list[Any]:
        """Every answer, in the order of `refs`; waits for all before raising, so no call is left running.
        A dead actor is dropped from `alive` and named in the error."""
        results, dead, error = [], [], None
        for i, ref in refs.items():
            try:
                results.append(ray.get(ref))
            except RayActorError as e:
                dead.append((i, e))
            except Exception as e:  # the engine's own error (a RayTaskError that is also its type)
                error = error or e
        if dead:
            self._drop([i for i, _ in dead])
            i, e = dead[0]
            raise RuntimeError(f"rollout actor {i} of {self.n} died: {e}") from e
        if error is not None:
            raise error
        return results

    def _drop(self, indices: Iterable[int]) -> None:
        gone = set(indices)
        self.alive = [i for i in self.alive if i not in gone]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """`engine.method(*args, **kwargs)` on every live actor; their answers in actor order."""
        self._check_any_alive()
        return self._gather({i: getattr(self.actors[i], method).remote(*args, **kwargs) for i in self.alive})

    def get(self, name: str) -> list[Any]:
        """A property of every live engine (e.g. "weight_version"), in actor order."""
        return self.call("get", name)

    def remove_dead(self, timeout: float = PING_TIMEOUT_S) -> list[int]:
        """Ping every live actor; drop those that died and return their indices."""
        dead = []
        for i in list(self.alive):
            try:
                ray.get(self.actors[i].info.remote(), timeout=timeout)
            except RayActorError:
                dead.append(i)
        self._drop(dead)
        return dead

    def _check_any_alive(self) -> None:
        if not self.alive:
            raise RuntimeError(f"all {self.n} rollout actors died")

    # -- generate ---------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
    ) -> list[RequestOutput]:
        """Engine.generate over the live actors: prompt j goes to live actor j mod count (its n samples
        stay together, sharing the prompt's cached pages); outputs come back in input order.

        With seeded (SamplingParams(seed=...)) or greedy sampling they equal one Engine's outputs for the
        same inputs (request ids aside); unseeded samples draw seeds from each engine's own stream.
        """
        self._check_any_alive()
        key, items = _batch(prompts, input_ids)
        params = _per_prompt(sampling_params, len(items))
        if not items:  # let one engine give its own answer (an error) for an empty batch
            first = self.alive[0]
            return self._gather({first: self.actors[first].generate.remote(**{key: items})})[0]
        shares: dict[int, list[int]] = {}
        for j in range(len(items)):
            shares.setdefault(self.alive[j % len(self.alive)], []).append(j)
        refs = {
            i: self.actors[i].generate.remote(
                **{key: [items[j] for j in js]},
                sampling_params=None if params is None else [params[j] for j in js],
                use_tqdm=False,
            )
            for i, js in shares.items()
        }
        outputs: list[Any] = [None] * len(items)
        for js, outs in zip(shares.values(), self._gather(refs)):
            for j, out in zip(js, outs):
                outputs[j] = out
        return outputs

    # -- memory -----------------------------------------------------------------------------------
    def release(self, tags: str | Iterable[str] | None = None, **kwargs: Any) -> None:
        """release_memory_occupation on every live engine (same arguments)."""
        self.call("release_memory_occupation", tags, **kwargs)

    def resume(self, tags: str | Iterable[str] | None = None) -> None:
        """resume_memory_occupation on every live engine."""
        self.call("resume_memory_occupation", tags)

    # -- weights ----------------------------------------------------------------------------------
    def sync_weights(
        self,
        model: torch.nn.Module,
        *,
        backend: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        abort: bool = False,
        master_address: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> SyncStats:
        """Broadcast `model`'s weights to every live engine at once: this process is rank 0, actor k of
        the live ones rank 1 + k. The group is made on the first call and kept; it is made again when
        the live actors change.

        backend: "nccl" when the model and every engine are on CUDA (each on its own GPU), else "gloo"
        (also the choice for engines sharing the trainer's GPU: NCCL refuses two ranks on one GPU).
        Weights travel in the engines' dtype.
        """
        self._check_any_alive()
        device = next(model.parameters()).device
        backend = backend or self._default_backend(device)
        sender = self._group_sender(backend, device, master_address, timeout)
        self._abort = abort
        try:
            return sync_weights(model, sender, bucket_bytes=bucket_bytes, dtype=self._engine_dtype())
        except BaseException as e:
            self._close_sender()  # a failed broadcast leaves the group out of step
            dead = self.remove_dead()
            if dead:
                raise RuntimeError(f"rollout actor {dead[0]} of {self.n} died: {e}") from e
            raise

    def _default_backend(self, device: torch.device) -> str:
        engines_on_cuda = all(self.infos[i]["device"].startswith("cuda") for i in self.alive)
        return "nccl" if device.type == "cuda" and engines_on_cuda else "gloo"

    def _engine_dtype(self) -> torch.dtype:
        return getattr(torch, self.infos[self.alive[0]]["dtype"])

    def _group_sender(
        self, backend: str, device: torch.device, master_address: str | None, timeout: float
    ) -> BroadcastSender:
        s = self._sender
        if s is not None and self._sender_members == self.alive and s.group.backend == backend:
            return s
        self._close_sender()
        address = master_address or _local_address()
        port, name, world = free_port(), f"rollout-ray-{uuid.uuid4().hex[:8]}", 1 + len(self.alive)
        joins = {
            i: self.actors[i].init_weights_update_group.remote(
                address, port, 1 + k, world, name, backend, timeout=timeout
            )
            for k, i in enumerate(self.alive)
        }
        try:
            sender = BroadcastSender(
                address,
                port,
                world,
                name,
                backend,
                device=device if backend == "nccl" else "cpu",
                timeout=timeout,
                on_update=self._on_update,
            )
        except BaseException:
            _settle_quietly(lambda: self._gather(joins))
            raise
        self._gather(joins)
        self._sender, self._sender_members = sender, list(self.alive)
        return sender

    def _on_update(self, **spec: Any) -> _Pending:
        refs = {
            i: self.actors[i].update_weights_from_distributed.remote(**spec, abort=self._abort)
            for i in self._sender_members
        }
        return _Pending(self, refs)

    def _close_sender(self) -> None:
        sender, self._sender = self._sender, None
        if sender is None:
            return
        name = sender.group_name
        live = [i for i in self._sender_members if i in self.alive]
        # our side first: after a failed broadcast, engines still receiving fail once rank 0 has left,
        # and only then can they take the destroy call
        _settle_quietly(sender.close)
        _settle_quietly(
            lambda: self._gather({i: self.actors[i].destroy_weights_update_group.remote(name) for i in live})
        )

    # -- lifetime ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Leave the broadcast group, end the actors and free their placement group. Safe to call twice."""
        self._close_sender()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.alive = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def __enter__(self) -> RolloutGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __getstate__(self) -> dict[str, Any]:
        # handed to another process (a trainer actor): that process makes its own broadcast group
        return {**self.__dict__, "_sender": None, "_sender_members": []}


def _batch(prompts: Any, input_ids: Any) -> tuple[str, list]:
    """("prompts" or "input_ids", one entry per prompt)."""
    if (prompts is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompts (text) or input_ids (token ids)")
    if prompts is not None:
        return "prompts", [prompts] if isinstance(prompts, str) else list(prompts)
    ids = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
    if ids and all(isinstance(t, int) for t in ids):  # one prompt as a flat list of ids
        ids = [ids]
    return "input_ids", ids


def _per_prompt(params: Any, count: int) -> list[SamplingParams] | None:
    if params is None:
        return None
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params has {len(params)} entries for {count} prompts")
    return params


def _local_address() -> str:
    """Loopback when the whole cluster is this node, else this node's address (engines on other
    nodes connect to it)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return "127.0.0.1" if len(nodes) <= 1 else ray.util.get_node_ip_address()


def _settle_quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:
        pass
