"""Weights by Hugging Face name: validate a whole set first, then copy into the existing parameters.

Validation before any write is what makes an update all-or-nothing: a bad name, shape or dtype raises
with the engine's weights untouched.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


@dataclass(frozen=True)
class WeightTarget:
    """Where one Hugging Face tensor goes: a loadable module, its parameter and a fused shard."""

    name: str
    module: nn.Module
    param: str
    shard: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.module.hf_shape(self.param, self.shard))

    def load(self, full: torch.Tensor) -> None:
        self.module.load(self.param, self.shard, full)

    def read(self) -> torch.Tensor:
        return self.module.read(self.param, self.shard)


def resolve(model: nn.Module, name: str, shape: Iterable[int], dtype: torch.dtype) -> WeightTarget | None:
    """Check one incoming tensor against the model; None for entries the model ignores."""
    if not isinstance(name, str):
        raise TypeError(f"weight name must be a str, got {type(name).__name__}")
    found = model.resolve(name)
    if found is None:
        return None
    target = WeightTarget(name, *found)
    if tuple(shape) != target.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(shape)}, the model expects {target.shape}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"weight {name!r} has dtype {dtype}, expected a floating-point dtype")
    return target


def resolve_all(
    model: nn.Module, specs: Iterable[tuple[str, Iterable[int], torch.dtype]]
) -> list[WeightTarget | None]:
    targets, seen = [], set()
    for name, shape, dtype in specs:
        if name in seen:
            raise ValueError(f"weight {name!r} appears twice in one update")
        seen.add(name)
        targets.append(resolve(model, name, shape, dtype))
    return targets


@torch.no_grad()
def load_tensors(model: nn.Module, named: list[tuple[str, torch.Tensor]]) -> int:
    """Validate every (name, tensor), then load them all. Returns how many were loaded."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight {name!r} must be a torch.Tensor, got {type(t).__name__}")
    targets = resolve_all(model, ((n, t.shape, t.dtype) for n, t in named))
    for target, (_, t) in zip(targets, named):
        if target is not None:
            target.load(t)
    return sum(t is not None for t in targets)


# -- checkpoints on disk ---------------------------------------------------------------------------
def safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {str(path)!r}")
    return files


def checkpoint_specs(files: list[Path]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor, read from the headers alone."""
    from safetensors import safe_open

    specs = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                specs.append(
                    (name, tuple(sl.get_shape()), SAFETENSORS_DTYPES.get(sl.get_dtype(), torch.int64))
                )
    return specs


def iter_checkpoint(
    files: list[Path], device: str | torch.device = "cpu", only: Container[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor, or of those in `only` (the others are never read)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as sf:
            for name in sf.keys():
                if only is None or name in only:
                    yield name, sf.get_tensor(name)


@torch.no_grad()
def load_checkpoint(
    model: nn.Module,
    path: str | Path,
    *,
    require_all: bool = True,
    keep: Callable[[str], bool] | None = None,
) -> int:
    """Load a HF checkpoint folder after validating every tensor's name/shape/dtype from the headers.
    `keep(name)` selects the tensors to load (a partial update); every header is still validated."""
    files = safetensors_files(path)
    targets = {t.name: t for t in resolve_all(model, checkpoint_specs(files)) if t is not None}
    if keep is not None:
        targets = {n: t for n, t in targets.items() if keep(n)}
    if require_all:
        missing = [n for n in model.hf_names() if n not in targets]
        if missing:
            raise ValueError(f"checkpoint {str(path)!r} lacks {len(missing)} weights, e.g. {missing[:3]}")
    for name, tensor in iter_checkpoint(files, only=targets):
        targets[name].load(tensor)
    return len(targets)
