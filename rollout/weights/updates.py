"""The engine's weight methods: take new weights by Hugging Face name from tensors, a flattened bucket,
a broadcast group or a checkpoint folder; read them back.

Every update is all-or-nothing: the whole set is validated (names, shapes, dtypes) before the first
byte is written, and copies go into the existing parameter storage (CUDA graphs and memory-saver
regions stay valid). A successful update flushes the prefix cache and bumps `weight_version`.
Transports hand full HF tensors to `WeightTarget.load`, which slices for tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rollout.weights import broadcast
from rollout.weights.bucket import as_bucket, unpack
from rollout.weights.loader import WeightTarget, load_checkpoint, load_tensors

LOAD_FORMATS = (None, "flattened_bucket")


class WeightsMixin:
    """Mixed into Engine; uses its `model`, `pages`, `scheduler`, `device`, `tp`, `weight_version` and
    the memory checks of MemoryMixin (`_check_weights_resident`, `_mark_weights_loaded`)."""

    # -- updates ----------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights_from_tensor(
        self, named_tensors: Any, load_format: str | None = None, *, abort: bool = False
    ) -> int:
        """Load `named_tensors`: a list of (HF name, tensor), or with load_format="flattened_bucket" a
        FlattenedBucket (or SGLang's {"flattened_tensor", "metadata"} dict). Returns tensors loaded."""
        _check_format(load_format)
        if load_format == "flattened_bucket":
            named = unpack(as_bucket(named_tensors))
        else:
            named = _as_named_list(named_tensors)
        return self._apply_update(named, abort)

    @torch.no_grad()
    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Any],
        group_name: str,
        load_format: str | None = None,
        *,
        abort: bool = False,
    ) -> int:
        """Receive tensors broadcast by rank 0 of `group_name` (one per name, in order, or one flattened
        buffer), then load them. They land in temporary buffers and are checked against the model
        once the broadcast is done (the sender never waits on a refusal); a bad set leaves the weights
        as they were. A malformed spec (lengths, dtype names, shapes) cannot be received at all: it is
        refused at once, and the sender's broadcast times out."""
        _check_format(load_format)
        group = self._update_group(group_name)
        names, dtypes, shapes = list(names), list(dtypes), list(shapes)
        if load_format == "flattened_bucket":
            named = unpack(broadcast.receive_bucket(group, names, dtypes, shapes))
        else:
            named = broadcast.receive_tensors(group, names, dtypes, shapes)
        return self._apply_update(named, abort)

    @torch.no_grad()
    def update_weights_from_disk(self, model_path: str | Path, *, abort: bool = False) -> int:
        """Load every weight of a HF checkpoint folder with the same architecture and shapes."""
        from rollout.models.config import ModelConfig

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path: {str(model_path)!r} is not a folder with a config.json")
        arch = ModelConfig.from_path(str(path)).architecture
        if arch != self.model_config.architecture:
            raise ValueError(f"model_path holds a {arch}, the engine runs a {self.model_config.architecture}")
        self._before_weight_update(abort)
        count = load_checkpoint(self.model, path)  # validates every header before the first write
        self._after_weight_update(None)
        return count

    def _apply_update(self, named: list[tuple[str, torch.Tensor]], abort: bool) -> int:
        if not named:
            raise ValueError("the update holds no tensors")
        self._before_weight_update(abort)
        count = load_tensors(self.model, named)
        self._after_weight_update([name for name, _ in named])
        return count

    def _before_weight_update(self, abort: bool) -> None:
        """Refuse when the weights are released, or while requests run (their KV would mix two
        models) unless told to abort them."""
        self._check_weights_resident("updating weights")
        if self.scheduler.has_work():
            if not abort:
                raise RuntimeError(
                    "requests are in flight; finish them first or pass abort=True to abort them"
                )
            self.scheduler.abort_all()

    def _after_weight_update(self, names: list[str] | None) -> None:
        self._mark_weights_loaded(names)  # discarded weights count as valid again once all are loaded
        self.pages.flush()  # cached prefixes hold KV computed by the old weights
        self.weight_version += 1

    # -- broadcast groups -------------------------------------------------------------------------
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        *,
        timeout: float = broadcast.DEFAULT_TIMEOUT_S,
    ) -> None:
        """Join a trainer's broadcast group as rank `rank_offset + tp rank`; blocks until all joined."""
        groups = self._weight_groups
        if group_name in groups:
            raise ValueError(f"a weights update group named {group_name!r} exists already")
        if not isinstance(rank_offset, int) or rank_offset < 1:
            raise ValueError(f"rank_offset must be an int >= 1 (rank 0 is the trainer), got {rank_offset!r}")
        rank = rank_offset + self.tp.rank
        groups[group_name] = broadcast.join_group(
            master_address,
            master_port,
            rank,
            world_size,
            group_name,
            backend,
            device=self.device,
            timeout=timeout,
        )

    def destroy_weights_update_group(self, group_name: str) -> None:
        broadcast.leave_group(self._update_group(group_name))
        del self._weight_groups[group_name]

    def _update_group(self, group_name: str) -> broadcast.UpdateGroup:
        group = self._weight_groups.get(group_name)
        if group is None:
            known = sorted(self._weight_groups) or "none"
            raise ValueError(
                f"no weights update group named {group_name!r} (known: {known}); "
                "call init_weights_update_group first"
            )
        return group

    @property
    def _weight_groups(self) -> dict[str, broadcast.UpdateGroup]:
        return self.__dict__.setdefault("_weight_update_groups", {})

    # -- reading ----------------------------------------------------------------------------------
    @torch.no_grad()
    def get_weights_by_name(self, name: str, truncate_size: int | None = None) -> torch.Tensor:
        """A CPU copy of the weight as Hugging Face shapes it (fused q/k/v and gate/up split back out,
        tied embeddings answered for lm_head); `truncate_size` keeps the first rows only."""
        if truncate_size is not None and (not isinstance(truncate_size, int) or truncate_size < 0):
            raise ValueError(f"truncate_size must be a non-negative int or None, got {truncate_size!r}")
        if not isinstance(name, str):
            raise TypeError(f"weight name must be a str, got {type(name).__name__}")
        self._check_weights_resident("get_weights_by_name")
        found = self.model.resolve(name)
        if found is None:
            raise ValueError(f"{name!r} is not a weight of this model")
        t = WeightTarget(name, *found).read()
        if truncate_size is not None:
            t = t[:truncate_size]
        return t.detach().to("cpu", copy=True)


def _check_format(load_format: str | None) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be None or 'flattened_bucket', got {load_format!r}")


def _as_named_list(named_tensors: Any) -> list[tuple[str, torch.Tensor]]:
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
