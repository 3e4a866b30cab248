"""The engine's LoRA adapters: fixed slots, loading by PEFT name (all-or-nothing), and what a request's
`lora_name` means for the step (its slot) and for the prefix cache (its salt).

A load validates every tensor (names, shapes, rank, targets) before the first byte is written, so a
refused adapter leaves the engine as it was. Reloading a name copies into its slot in place (captured
CUDA graphs read the same buffers) and gives it a new load id: the prefix cache is salted with
(name, load id), so pages computed under the old adapter are never matched again.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollout.distributed import TPGroup
from rollout.layers.linear import ColumnLinear, RowLinear
from rollout.layers.packed import Packed
from rollout.lora.config import AdapterConfig
from rollout.lora.layers import LoraLinear, LoraState

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# <module>.lora_A.weight, or with the adapter's name kept: <module>.lora_A.default.weight
PEFT_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class Adapter:
    name: str
    slot: int  # 1..max_loras (0 is the base model)
    config: AdapterConfig
    load_id: int  # unique per load: salts the prefix cache


@dataclass(frozen=True)
class Target:
    """Where one HF module's adapter goes: the layer's slots, the shard, and the HF (out, in) shape."""

    lora: LoraLinear
    shard: int
    shape: tuple[int, int]


class LoraManager:
    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup,
    ):
        self.max_loras, self.max_rank, self.dtype, self.device = max_loras, max_rank, dtype, device
        self.state = LoraState(max_loras, max_rank, dtype, device)
        self.targets = _attach(model, self.state, tp, dtype, device)
        # the HF module names (the last part of a path) an adapter of this model may target
        self.supported = frozenset(path.rsplit(".", 1)[-1] for path in self.targets)
        self.adapters: dict[str, Adapter] = {}
        self._load_ids = itertools.count(1)

    @property
    def nbytes(self) -> int:
        layers = {id(t.lora): t.lora for t in self.targets.values()}
        return sum(lora.nbytes for lora in layers.values())

    # -- what requests see --------------------------------------------------------------------------
    def check_name(self, name: str | None) -> None:
        if name is not None and name not in self.adapters:
            raise ValueError(
                f"SamplingParams.lora_name: no LoRA adapter named {name!r} is loaded "
                f"(loaded: {sorted(self.adapters)})"
            )

    def slot(self, name: str | None) -> int:
        return 0 if name is None else self.adapters[name].slot

    def salt(self, name: str | None) -> Hashable | None:
        """The prefix-cache salt of a request on `name` (None: the base model's unsalted chain)."""
        return None if name is None else (name, self.adapters[name].load_id)

    # -- loads ------------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, name: str, tensors: Any, config: Mapping[str, Any], replace: bool) -> Adapter:
        _check_name(name)
        cfg = AdapterConfig.parse(config, self.supported)
        if name in self.adapters and not replace:
            raise ValueError(
                f"name: a LoRA adapter named {name!r} is already loaded; pass replace=True "
                "to update it in place, or unload it first"
            )
        if name not in self.adapters and len(self.adapters) >= self.max_loras:
            raise ValueError(
                f"name: all max_loras={self.max_loras} adapter slots are taken "
                f"({sorted(self.adapters)}); unload one first"
            )
        if cfg.rank > self.max_rank:
            raise ValueError(f"LoRA config: r={cfg.rank} exceeds the engine's max_lora_rank={self.max_rank}")
        pairs = self._validate(_named(tensors), cfg)
        slot = self.adapters[name].slot if name in self.adapters else self._free_slot()
        for module, target in self.targets.items():
            a, b = pairs.get(module, (None, None))
            target.lora.write(slot, target.shard, _cast(a, self), _cast(b, self))
        self.state.set_scale(slot, cfg.scale)
        adapter = Adapter(name, slot, cfg, next(self._load_ids))
        self.adapters[name] = adapter
        return adapter

    def load_folder(self, name: str, path: str | Path, replace: bool) -> Adapter:
        folder = Path(path)
        config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
        if not config_file.is_file() or not weights_file.is_file():
            raise ValueError(
                f"path: {str(path)!r} is not a PEFT adapter folder ({CONFIG_FILE} + {WEIGHTS_FILE})"
            )
        from safetensors.torch import load_file

        config = json.loads(config_file.read_text())
        return self.load(name, load_file(str(weights_file)), config, replace)

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(
                f"name: no LoRA adapter named {name!r} is loaded (loaded: {sorted(self.adapters)})"
            )
        adapter = self.adapters.pop(name)
        self.state.set_scale(adapter.slot, 0.0)  # a stale slot index can only ever read zeros

    def _free_slot(self) -> int:
        used = {a.slot for a in self.adapters.values()}
        return min(set(range(1, self.max_loras + 1)) - used)

    def _validate(
        self, named: list[tuple[str, torch.Tensor]], cfg: AdapterConfig
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """HF module name -> (lora_A, lora_B), every name and shape checked against the model."""
        if not named:
            raise ValueError("tensors: the adapter holds no tensors")
        found: dict[str, dict[str, torch.Tensor]] = {}
        for full, t in named:
            module, ab = self._parse_name(full)
            if module.rsplit(".", 1)[-1] not in cfg.targets:
                raise ValueError(
                    f"LoRA tensor {full!r}: its module is not in the config's target_modules "
                    f"{sorted(cfg.targets)}"
                )
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"LoRA tensor {full!r} must be a floating-point torch.Tensor")
            out_f, in_f = self.targets[module].shape
            want = (cfg.rank, in_f) if ab == "A" else (out_f, cfg.rank)
            if tuple(t.shape) != want:
                raise ValueError(
                    f"LoRA tensor {full!r} has shape {tuple(t.shape)}, expected {want} (r={cfg.rank})"
                )
            if not torch.isfinite(t).all():
                raise ValueError(f"LoRA tensor {full!r} holds NaN or inf")
            if ab in found.setdefault(module, {}):
                raise ValueError(f"LoRA tensor {full!r}: {module} lora_{ab} is given twice")
            found[module][ab] = t
        for module, ab in found.items():
            if len(ab) != 2:
                raise ValueError(f"LoRA tensors: {module} has lora_{''.join(ab)} but not its pair")
        return {m: (ab["A"], ab["B"]) for m, ab in found.items()}

    def _parse_name(self, full: str) -> tuple[str, str]:
        if not isinstance(full, str):
            raise TypeError(f"LoRA tensor names must be str, got {type(full).__name__}")
        m = PEFT_NAME.match(full.removeprefix(PEFT_PREFIX))
        if m is None:
            raise ValueError(f"LoRA tensor {full!r} is not a PEFT lora_A/lora_B weight name")
        module = m["module"]
        if module not in self.targets:
            raise ValueError(
                f"LoRA tensor {full!r}: {module!r} is not a module an adapter can target "
                f"(supported: {sorted(self.supported)} of the decoder layers)"
            )
        return module, m["ab"]


def _attach(
    model: nn.Module, state: LoraState, tp: TPGroup, dtype: torch.dtype, device: torch.device
) -> dict[str, Target]:
    """Give every module the model lists as a LoRA target (`lora_modules`) its adapter slots; HF module
    name -> Target."""
    if not hasattr(model, "lora_modules"):
        raise ValueError(f"max_loras: {type(model).__name__} lists no modules a LoRA adapter may target")
    targets: dict[str, Target] = {}
    for hf, (module, shard) in model.lora_modules().items():
        in_local, parts, row, shards = _geometry(module)
        if module.lora is None:
            module.lora = LoraLinear(
                state, in_local, parts, row_parallel=row, tp=tp, dtype=dtype, device=device
            )
        targets[hf] = Target(module.lora, shards.index(shard), module.hf_shape("weight", shard))
    if not targets:
        raise ValueError(f"max_loras: {type(model).__name__} has no module a LoRA adapter may target")
    return targets


def _geometry(module: nn.Module) -> tuple[int, list[list[int]], bool, list]:
    """(local input size, per fused shard the HF sizes of its parts, row-parallel?, shard names)."""
    if isinstance(module, RowLinear):
        return module.local_in, [[module.out_features]], True, [None]
    if isinstance(module, ColumnLinear):
        return module.in_features, [[n] for n in module.out_sizes], False, list(module.shard_names)
    if isinstance(module, Packed) and len(module.rest) == 1:
        return module.rest[0], [module.parts], False, [None]
    raise TypeError(f"LoRA: a {type(module).__name__} cannot hold adapter slots")


def _named(tensors: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    if isinstance(tensors, Iterable) and not isinstance(tensors, (str, bytes, torch.Tensor)):
        named = list(tensors)
        if all(isinstance(p, (tuple, list)) and len(p) == 2 for p in named):
            return [tuple(p) for p in named]  # type: ignore[misc]
    raise TypeError("tensors must be a dict of PEFT name -> tensor, or a list of (name, tensor) pairs")


def _cast(t: torch.Tensor | None, mgr: LoraManager) -> torch.Tensor | None:
    return None if t is None else t.to(device=mgr.device, dtype=mgr.dtype)


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: a LoRA adapter name must be a non-empty str, got {name!r}")
