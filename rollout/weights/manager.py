"""The engine's weights by Hugging Face name: take them from tensors, a flattened bucket, a broadcast
group or a checkpoint folder; read them back; know whether they are all valid.

Every load is all-or-nothing: the whole set is validated (names, shapes, dtypes) before the first byte
is written, and copies go into the existing parameter storage (CUDA graphs and memory-saver regions
stay valid). Transports hand full HF tensors to `WeightTarget.load`, which slices for tensor
parallelism. The engine decides when a load may run (nothing in flight, memory resident).

Updates of a signature seen before reuse its copy plan (weights/plan.py): validation was done when the
plan was built, and the load is the finite check and one batched copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from rollout.distributed import TPGroup
from rollout.models.config import ModelConfig
from rollout.weights import broadcast, checksum, direct
from rollout.weights.bucket import as_bucket
from rollout.weights.loader import (
    WeightTarget,
    checkpoint_specs,
    load_checkpoint,
    weight_files,
)
from rollout.weights.plan import PlanCache, Prepared

log = logging.getLogger("rollout")

LOAD_FORMATS = (None, "flattened_bucket", "direct")
Named = list[tuple[str, torch.Tensor]]


class WeightManager:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, device: torch.device, tp: TPGroup):
        self.model, self.model_config, self.device, self.tp = model, model_config, device, tp
        self.version = 0  # bumped by every successful load
        self._missing: set[str] = set()  # HF names not loaded since the weights were discarded
        self._groups: dict[str, broadcast.UpdateGroup] = {}
        self.plans = PlanCache(model)
        self._order: list[str] | None = None  # storage_order(): the storage never moves
        self._said_reloaded = False  # the "all weights loaded" line was logged once

    # -- validity ---------------------------------------------------------------------------------
    def discard(self) -> None:
        """The weights' contents are gone (released without a backup): every name must be loaded again."""
        self._missing = set(self.model.hf_names())

    def check_valid(self, action: str) -> None:
        if self._missing:
            total = len(self.model.hf_names())
            raise RuntimeError(
                f"{action}: the weights were discarded by release_memory_occupation() and "
                f"{len(self._missing)} of {total} have not been loaded since "
                f"(e.g. {sorted(self._missing)[:3]}); push new weights with update_weights_*, "
                "or release with keep_weights_backup=True"
            )

    def _loaded(self, names: Iterable[str] | None) -> None:
        self.version += 1
        if not self._missing:
            return
        if names is None:
            self._missing.clear()
        else:
            self._missing.difference_update(names)
        if not self._missing:
            # once per engine: a colocated trainer discards and reloads every step, and a line per step
            # says nothing new (and breaks its progress bar)
            level = logging.DEBUG if self._said_reloaded else logging.INFO
            log.log(level, "all weights loaded since they were discarded: the engine can generate again")
            self._said_reloaded = True

    # -- what arrives -----------------------------------------------------------------------------
    def unpack(self, named_tensors: Any, load_format: str | None) -> Prepared:
        """A list/dict of (HF name, tensor) pairs or a FlattenedBucket (or SGLang's dict), validated
        against its copy plan (built on first sight of its signature) and ready to load."""
        _check_format(load_format)
        if load_format == "flattened_bucket":
            return self.plans.bucket(as_bucket(named_tensors))
        named = _as_named_list(named_tensors)
        if not named:
            raise ValueError("the update holds no tensors")
        return self.plans.tensors(named)

    def receive(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Any],
        group_name: str,
        load_format: str | None,
    ) -> Prepared:
        """Tensors broadcast by rank 0 of `group_name` (one per name, in order, or one flattened buffer).
        They land in temporary buffers (the sender never waits on a refusal); a malformed spec cannot be
        received at all and is refused at once (the sender's broadcast then times out)."""
        _check_format(load_format)
        group = self._group(group_name)
        names, dtypes, shapes = list(names), list(dtypes), list(shapes)
        if load_format == "flattened_bucket":
            return self.plans.bucket(broadcast.receive_bucket(group, names, dtypes, shapes))
        named = broadcast.receive_tensors(group, names, dtypes, shapes)
        if not named:
            raise ValueError("the update holds no tensors")
        return self.plans.tensors(named)

    # -- loads ------------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, update: Prepared | Named) -> int:
        """Load a prepared update (or a list of pairs, prepared here); all or nothing."""
        if not isinstance(update, Prepared):
            update = self.plans.tensors(update)
        count = update.load()
        self._loaded(update.names)
        return count

    def load_direct(self, named: Named) -> int:
        """Tensors named as the engine stores them (weights/direct.py); all or nothing."""
        named = _as_named_list(named)
        count = direct.load_direct(self.model, named)
        self._loaded(direct.hf_names_written(self.model, [n for n, _ in named]))
        return count

    def load_custom(self, loader: Callable[[torch.nn.Module, list], Any], named: Named) -> None:
        """Run a caller's loader over the model (SGLang's custom_weight_loader); what it writes is the
        caller's to validate."""
        named = _as_named_list(named)
        direct.load_custom(self.model, loader, named)
        self._loaded(direct.hf_names_written(self.model, [n for n, _ in named if isinstance(n, str)]))

    def storage_order(self) -> list[str]:
        """The HF names in the order their bytes lie in the engine's weight storage: a bucket packed in
        this order, in the engine's dtype, loads as one copy per contiguous run."""
        if self._order is None:
            self._order = self._storage_order()
        return list(self._order)

    def _storage_order(self) -> list[str]:
        names = self.model.hf_names()
        if getattr(self.model, "weight_storage", None) is None or self.tp.size != 1:
            return names  # a rank's slices are not the bytes a trainer packs: any order will do
        offsets = {name: WeightTarget(name, *self.model.resolve(name)).read().data_ptr() for name in names}
        return sorted(names, key=offsets.__getitem__)

    @torch.no_grad()
    def load_disk(self, model_path: str | Path, weight_name_filter: Any = None) -> int:
        """The weights of a HF checkpoint folder with the same architecture and shapes: all of them, or
        those `weight_name_filter` selects (a callable on the HF name, or a list of names)."""
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path: {str(model_path)!r} is not a folder with a config.json")
        arch = ModelConfig.from_path(str(path)).architecture
        if arch != self.model_config.architecture:
            raise ValueError(f"model_path holds a {arch}, the engine runs a {self.model_config.architecture}")
        keep = _name_filter(weight_name_filter, path)
        loaded: list[str] = []  # what the filter selected, for the validity bookkeeping

        def wanted(name: str) -> bool:
            if keep(name):
                loaded.append(name)
                return True
            return False

        # validates every header before the first write
        count = load_checkpoint(
            self.model, path, require_all=keep is None, keep=None if keep is None else wanted
        )
        if keep is not None and count == 0:
            raise ValueError("weight_name_filter selected no weight of the checkpoint")
        self._loaded(None if keep is None else loaded)
        return count

    # -- broadcast groups -------------------------------------------------------------------------
    def join_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout: float,
    ) -> None:
        if group_name in self._groups:
            raise ValueError(f"a weights update group named {group_name!r} exists already")
        if not isinstance(rank_offset, int) or rank_offset < 1:
            raise ValueError(f"rank_offset must be an int >= 1 (rank 0 is the trainer), got {rank_offset!r}")
        self._groups[group_name] = broadcast.join_group(
            master_address,
            master_port,
            rank_offset + self.tp.rank,
            world_size,
            group_name,
            backend,
            device=self.device,
            timeout=timeout,
        )

    def leave_group(self, group_name: str) -> None:
        broadcast.leave_group(self._group(group_name))
        del self._groups[group_name]

    def _group(self, group_name: str) -> broadcast.UpdateGroup:
        group = self._groups.get(group_name)
        if group is None:
            known = sorted(self._groups) or "none"
            raise ValueError(
                f"no weights update group named {group_name!r} (known: {known}); "
                "call init_weights_update_group first"
            )
        return group

    # -- reads ------------------------------------------------------------------------------------
    @torch.no_grad()
    def read(self, name: str, truncate_size: int | None) -> torch.Tensor:
        """A CPU copy of the weight as Hugging Face shapes it (fused q/k/v and gate/up split back out,
        tied embeddings answered for lm_head); `truncate_size` keeps the first rows only."""
        if truncate_size is not None and (not isinstance(truncate_size, int) or truncate_size < 0):
            raise ValueError(f"truncate_size must be a non-negative int or None, got {truncate_size!r}")
        if not isinstance(name, str):
            raise TypeError(f"weight name must be a str, got {type(name).__name__}")
        found = self.model.resolve(name)
        if found is None:
            raise ValueError(f"{name!r} is not a weight of this model")
        t = WeightTarget(name, *found).read()
        if truncate_size is not None:
            t = t[:truncate_size]
        return t.detach().to("cpu", copy=True)

    @torch.no_grad()
    def checksums(self, names: Sequence[str] | None) -> dict[str, int]:
        """Per HF name, the checksum of the weight as Hugging Face shapes it (weights/checksum.py),
        computed where the weight lives; fused parameters are read as their HF slices."""
        if names is None:
            names = self.model.hf_names()
        elif isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise TypeError(f"names must be a list of weight names or None, got {type(names).__name__}")
        targets = []
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"names: weight name must be a str, got {type(name).__name__}")
            found = self.model.resolve(name)
            if found is None:
                raise ValueError(f"names: {name!r} is not a weight of this model")
            targets.append(WeightTarget(name, *found))
        return dict(zip(names, checksum.checksums(t.read() for t in targets)))


def _name_filter(weight_name_filter: Any, path: Path) -> Callable[[str], bool] | None:
    """The filter as a predicate; a list's names must all be in the checkpoint (a typo loads nothing)."""
    if weight_name_filter is None or callable(weight_name_filter):
        return weight_name_filter
    if isinstance(weight_name_filter, str) or not isinstance(weight_name_filter, (list, tuple, set)):
        raise TypeError(
            "weight_name_filter must be a callable or a list of weight names, "
            f"got {type(weight_name_filter).__name__}"
        )
    names = set(weight_name_filter)
    if not all(isinstance(n, str) for n in names):
        raise TypeError("weight_name_filter: every entry must be a str weight name")
    present = {n for n, _, _ in checkpoint_specs(weight_files(path))}
    absent = sorted(names - present)
    if absent:
        raise ValueError(f"weight_name_filter: {absent[:3]} not in the checkpoint {str(path)!r}")
    return names.__contains__


def _check_format(load_format: str | None) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be None, 'flattened_bucket' or 'direct', got {load_format!r}")


def _as_named_list(named_tensors: Any) -> Named:
    if isinstance(named_tensors, dict):
        named_tensors = list(named_tensors.items())
    if not isinstance(named_tensors, (list, tuple)):
        raise TypeError(
            f"named_tensors must be a list of (name, tensor) pairs, got {type(named_tensors).__name__}"
        )
    out = []
    for i, item in enumerate(named_tensors):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise TypeError(f"named_tensors[{i}] must be a (name, tensor) pair, got {type(item).__name__}")
        out.append((item[0], item[1]))
    return out
