"""Engines inside a torchrun job: one per rank or one per tensor-parallel group, fed from a global batch.

    env = init_distributed()                                  # no-op when the trainer already did it
    engine = build_engine(path, tp_size=2)                    # every rank; groups of 2 consecutive ranks
    rollout = DataParallelRollout(engine)                     # every rank (makes a gloo group)
    outs = rollout.generate(input_ids=global_batch, sampling_params=params)   # every rank, same batch

Each engine group serves a contiguous share of the global batch and the outputs come back in the
batch's order, to every rank (`dst="all"`), to one rank (`dst=0`), or not at all (`dst=None`: each rank
keeps its group's share, `rollout.layout.share(len(batch))`). Requests without a seed get one from the
rollout's own seeded stream, so the samples do not depend on how many groups there are.

Every call here is collective: all ranks make it, in the same order.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollout import Engine, RequestOutput, SamplingParams


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in the job, as torchrun describes it in the environment."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TorchrunEnv:
        values = {}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            raw = environ.get(name)
            if raw is None or not raw.isdigit():
                raise ValueError(f"environment variable {name}={raw!r}: launch with torchrun (or set it)")
            values[name] = int(raw)
        if values["RANK"] >= values["WORLD_SIZE"]:
            raise ValueError(f"RANK={values['RANK']} is not below WORLD_SIZE={values['WORLD_SIZE']}")
        return cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])

    @property
    def device(self) -> torch.device:
        """The GPU torchrun gives this process, or the CPU when there is none."""
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed(*, backend: str | None = None, timeout_s: float = 1800.0) -> TorchrunEnv:
    """Initialise torch.distributed from torchrun's environment, unless the trainer already did."""
    env = TorchrunEnv.from_env()
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    if not dist.is_initialized():
        default = "cpu:gloo,cuda:nccl" if env.device.type == "cuda" else "gloo"
        dist.init_process_group(backend or default, timeout=timedelta(seconds=timeout_s))
    if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
        raise ValueError(
            f"torch.distributed has rank {dist.get_rank()} of {dist.get_world_size()}, torchrun says "
            f"{env.rank} of {env.world_size}"
        )
    return env


def build_engine(model: str, *, tp_size: int = 1, **options: Any) -> Engine:
    """An engine on this rank's device, tensor-parallel over groups of `tp_size` consecutive ranks."""
    options.setdefault("device", str(TorchrunEnv.from_env().device))
    return Engine(model, tp_size=tp_size, **options)


@dataclass(frozen=True)
class Layout:
    """The engine groups of the world, ordered by their first rank; a group's index is its dp rank."""

    groups: tuple[tuple[int, ...], ...]
    rank: int

    @classmethod
    def from_reports(cls, reports: list[tuple[int, ...]], rank: int) -> Layout:
        """`reports[r]`: the global ranks of rank r's engine group (they must partition the world)."""
        world = range(len(reports))
        for r, ranks in enumerate(reports):
            if r not in ranks or any(o not in world or reports[o] != ranks for o in ranks):
                raise ValueError(
                    f"engine groups do not partition the world: rank {r} reports the group {list(ranks)}, "
                    f"which its members do not all report"
                )
        return cls(tuple(sorted(set(reports))), rank)

    @property
    def size(self) -> int:
        return len(self.groups)

    @property
    def index(self) -> int:
        return next(i for i, g in enumerate(self.groups) if self.rank in g)

    def leader(self, index: int) -> int:
        return self.groups[index][0]

    def share(self, n: int, index: int | None = None) -> range:
        """The contiguous slice of an n-item batch that group `index` (default: ours) serves."""
        i = self.index if index is None else index
        base, extra = divmod(n, self.size)
        start = i * base + min(i, extra)
        return range(start, start + base + (i < extra))


class DataParallelRollout:
    """Splits a global batch over the engine groups of a torchrun job and gathers the outputs.

    Collective: build it on every rank. It makes one gloo group over the world for its small object
    exchanges (prompts, status, outputs), so the trainer's default group is left alone.
    """

    def __init__(self, engine: Engine, *, seed: int = 0, timeout_s: float = 1800.0):
        if not dist.is_initialized():
            raise ValueError("DataParallelRollout needs torch.distributed initialised (init_distributed())")
        self.engine = engine
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.world_size = dist.get_world_size()
        self.layout = Layout.from_reports(self._all_gather(tuple(engine.tp.ranks)), dist.get_rank())
        self._rng = random.Random(seed)

    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        input_ids: Any = None,
        dst: int | str | None = "all",
        src: int | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput] | None:
        """Generate for a global batch; every rank passes the same batch (or rank `src` alone does).

        dst: "all" (every rank gets every output), a global rank (that rank does, the others get
        None), or None (each rank gets its own group's share, `layout.share(len(batch))`).
        """
        if not (dst in ("all", None) or isinstance(dst, int) and 0 <= dst < self.world_size):
            raise ValueError(f"dst must be 'all', None or a rank in [0, {self.world_size}), got {dst!r}")
        if src is not None:
            box = [prompts, input_ids, sampling_params]
            dist.broadcast_object_list(box, src=src, group=self.group)
            prompts, input_ids, sampling_params = box
        key, items, params = self._agree_on_batch(prompts, input_ids, sampling_params, check_same=src is None)
        share = self.layout.share(len(items))
        mine: list[RequestOutput] = []
        error = None
        if len(share):
            try:
                mine = self.engine.generate(
                    sampling_params=[params[i] for i in share],
                    use_tqdm=use_tqdm,
                    **{key: [items[i] for i in share]},
                )
            except Exception as e:  # the other groups must hear of it rather than wait at the gather
                error = e
        self._raise_if_any_failed(error, "generate")
        return self._collect(mine, dst)

    # -- steps ----------------------------------------------------------------------------------------
    def _agree_on_batch(
        self, prompts: Any, input_ids: Any, sampling_params: Any, check_same: bool
    ) -> tuple[str, list[Any], list[SamplingParams]]:
        error, report = None, None
        try:
            key, items = _split_batch(prompts, input_ids)
            params = _per_prompt_params(sampling_params, len(items))
            report = hashlib.sha256(repr((key, items, params)).encode()).hexdigest()
        except (TypeError, ValueError) as e:
            error = e
        reports = self._raise_if_any_failed(error, "generate inputs", report)
        if check_same and any(r != reports[0] for r in reports):
            differ = [r for r, d in enumerate(reports) if d != reports[0]]
            raise ValueError(
                f"ranks {differ} passed a different global batch than rank 0; pass the same batch on "
                f"every rank, or pass src=<rank> to take it from one rank"
            )
        # seeds for unseeded requests: drawn identically on every rank, before the split
        params = [p if p.seed is not None else replace(p, seed=self._rng.getrandbits(63)) for p in params]
        return key, items, params

    def _raise_if_any_failed(self, error: Exception | None, what: str, report: Any = None) -> list[Any]:
        """Exchange (error or report) over the world; raise on every rank if any rank failed."""
        states = self._all_gather(("error", f"{type(error).__name__}: {error}") if error else ("ok", report))
        if error is not None:
            raise error
        failed = {r: msg for r, (kind, msg) in enumerate(states) if kind == "error"}
        if failed:
            r, msg = next(iter(failed.items()))
            raise RuntimeError(f"{what} failed on rank(s) {list(failed)}; rank {r}: {msg}")
        return [reported for _, reported in states]

    def _collect(self, mine: list[RequestOutput], dst: int | str | None) -> list[RequestOutput] | None:
        if dst is None:
            return mine
        # one copy per group: the group's first rank sends, its other ranks hold the same outputs
        sent = mine if dist.get_rank() == self.layout.leader(self.layout.index) else None
        if dst == "all":
            parts = self._all_gather(sent)
        else:
            parts = [None] * self.world_size if dist.get_rank() == dst else None
            dist.gather_object(sent, parts, dst=dst, group=self.group)
            if parts is None:
                return None
        return [out for i in range(self.layout.size) for out in parts[self.layout.leader(i)]]

    def _all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _split_batch(prompts: Any, input_ids: Any) -> tuple[str, list[Any]]:
    """("prompts", texts) or ("input_ids", token lists): the items the groups split between them."""
    if (prompts is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompts (text) or input_ids (token ids)")
    if prompts is not None:
        items = [prompts] if isinstance(prompts, str) else prompts
        if not isinstance(items, Sequence) or not all(isinstance(p, str) for p in items):
            raise TypeError("prompts must be a str or a list of str")
        if not items:
            raise ValueError("no prompts given")
        return "prompts", list(items)
    ids = input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids
    if isinstance(ids, Sequence) and ids and all(isinstance(t, int) for t in ids):
        ids = [ids]
    lists = isinstance(ids, Sequence) and not isinstance(ids, str)
    if not lists or not all(isinstance(p, Sequence) and not isinstance(p, str) for p in ids):
        raise TypeError("input_ids must be a list of token ids or a list of such lists")
    if not ids:
        raise ValueError("no prompts given")
    return "input_ids", [list(p) for p in ids]


def _per_prompt_params(params: Any, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    if not isinstance(params, Sequence) or not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError("sampling_params must be a SamplingParams or a list of them")
    if len(params) != count:
        raise ValueError(f"sampling_params has {len(params)} entries for {count} prompts")
    return list(params)
