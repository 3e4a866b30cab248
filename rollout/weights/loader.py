"""Weights by Hugging Face name: validate a whole set first, then copy into the existing parameters.

Validation before any write is what makes an update all-or-nothing: a bad name, shape, dtype, kind of
tensor (meta, sparse, DTensor) or a NaN/inf value raises with the engine's weights untouched.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import nn

from rollout.layers.linear import deferred_params
from rollout.weights.bucket import parse_dtype

INDEX_FILE = "model.safetensors.index.json"
BIN_FILE, BIN_INDEX_FILE = "pytorch_model.bin", "pytorch_model.bin.index.json"
# Parameters start on multiples of this in the weight storage (kernels specialise on 16-byte aligned
# pointers); parameter sizes are multiples of it in practice, so the storage is gap-free and a bucket
# in storage order is a single run of bytes.
PARAM_ALIGN = 16
# Threads that copy checkpoint tensors into the engine at start-up (ROLLOUT_LOAD_THREADS=1: one)
LOAD_THREADS = int(os.environ.get("ROLLOUT_LOAD_THREADS", min(8, os.cpu_count() or 1)))


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

    def copy_pair(self, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(destination view, source view) when loading is one plain copy, else None (use load)."""
        pair = getattr(self.module, "copy_pair", None)
        return pair(self.param, self.shard, full) if pair is not None else None

    def read(self) -> torch.Tensor:
        return self.module.read(self.param, self.shard)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(self.module, self.param).dtype


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
    if not _castable(dtype, target.dtype):
        raise TypeError(f"weight {name!r} has dtype {dtype}, which torch cannot cast to {target.dtype}")
    return target


@functools.cache
def _castable(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether copy_ casts src into dst (float8 casts, float4 does not): tried once on one element."""
    try:
        torch.zeros(1, dtype=dst).copy_(torch.zeros(1, dtype=src))
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def check_tensor(name: Any, t: Any) -> None:
    """What copy_ needs beyond name, shape and dtype: a dense tensor holding data in this process."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"weight {name!r} must be a torch.Tensor, got {type(t).__name__}")
    if _is_dtensor(t):
        raise TypeError(f"weight {name!r} is a DTensor; send its full_tensor()")
    if t.is_meta:
        raise TypeError(f"weight {name!r} is a meta tensor, which holds no data")
    if t.layout != torch.strided or t.is_nested:
        raise TypeError(f"weight {name!r} has layout {t.layout}; send a dense tensor (to_dense())")


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def refuse_nonfinite(
    named: list[tuple[str, torch.Tensor]], dst_dtypes: list[torch.dtype] | None = None
) -> None:
    """Raise ValueError naming the tensors that hold NaN or inf or, given the dtypes they are loaded as
    (`dst_dtypes`, one per tensor), values that overflow to inf in that dtype. The largest magnitude of
    each tensor (NaN propagates through it, an inf is its own max; cast to the destination dtype, which
    rounds monotonically), batched per device and dtype, and one host sync per group: no copy of any
    tensor."""
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for k, (name, t) in enumerate(named):
        if t.numel() and (t.is_floating_point() or t.is_complex()):  # integers are always finite
            t = reducible(t)
            dst = dst_dtypes[k] if dst_dtypes is not None else t.dtype
            groups.setdefault((t.device, t.dtype, dst), []).append((name, t))
    bad = []
    for (_, _, dst), group in groups.items():
        finite = torch.isfinite(max_abs([t for _, t in group]).to(dst)).tolist()
        bad += [name for (name, _), ok in zip(group, finite) if not ok]
    if bad:
        raise ValueError(
            f"{len(bad)} weight(s) hold NaN or inf values (or values the engine's dtype cannot hold), "
            f"e.g. {bad[:3]}; nothing was loaded (check_finite=False loads them anyway)"
        )


def max_abs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The largest magnitude of each tensor (NaN when it holds one), as one 1-D tensor; the tensors share
    a device and dtype. On a GPU one multi-tensor kernel; on a CPU, where the max-norm kernel reads
    0.4 GB/s, min and max reductions (about 8 GB/s)."""
    if tensors[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(tensors, float("inf")))
    return torch.stack([torch.stack(torch.aminmax(t)).abs().max() for t in tensors])


def reducible(t: torch.Tensor) -> torch.Tensor:
    # aminmax has no float8 kernels; bfloat16 holds every float8 value exactly
    return t if t.dtype.itemsize > 1 else t.to(torch.bfloat16)


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


# -- one update's plan: validated once, then copies (plan.py caches them per signature) ------------
Named = Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class FiniteGroup:
    """Update positions whose tensors share a device and dtype, and the dtype they are loaded as."""

    positions: tuple[int, ...]
    dst_dtype: torch.dtype


@dataclass
class TensorPlan:
    """How to load a list of tensors of one signature: `whole[i]` is copied into `dsts[i]` as it is;
    `partial` entries (a tensor-parallel slice, a padded vocabulary) ask their target per update."""

    names: list[str]  # the loaded HF names (entries the model ignores are not in it)
    positions: list[int]  # their positions in the update
    whole: list[int]  # update positions copied whole
    dsts: list[torch.Tensor]  # engine storage views, one per `whole` entry
    partial: list[tuple[int, WeightTarget]]
    finite: list[FiniteGroup]

    @classmethod
    def build(cls, model: nn.Module, named: Named) -> TensorPlan:
        """Validate every (name, tensor) as load_tensors does; raises with nothing written."""
        for name, t in named:
            check_tensor(name, t)
        targets = resolve_all(model, ((n, t.shape, t.dtype) for n, t in named))
        names, positions, whole, dsts, partial = [], [], [], [], []
        groups: dict[tuple, list[int]] = {}
        for i, (target, (_, t)) in enumerate(zip(targets, named)):
            if target is None:
                continue
            names.append(target.name)
            positions.append(i)
            pair = target.copy_pair(t)
            if pair is not None and _is_whole(pair[1], t):
                whole.append(i)
                dsts.append(pair[0])
            else:
                partial.append((i, target))
            if t.numel() and t.is_floating_point():  # integers are always finite
                groups.setdefault((t.device, t.dtype, target.dtype), []).append(i)
        finite = [FiniteGroup(tuple(idx), key[2]) for key, idx in groups.items()]
        return cls(names, positions, whole, dsts, partial, finite)

    def run(self, tensors: Sequence[torch.Tensor], check_finite: bool = True) -> int:
        """Load `tensors` (in update order, of this plan's signature). Returns how many were loaded."""
        if check_finite:
            self.check_finite(tensors)
        dsts, srcs = list(self.dsts), [tensors[i] for i in self.whole]
        for i, target in self.partial:
            pair = target.copy_pair(tensors[i])
            if pair is None:
                target.load(tensors[i])
            else:
                dsts.append(pair[0])
                srcs.append(pair[1])
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return len(self.names)

    def check_finite(self, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse values that are, or would load as, NaN or inf: the max-abs of each tensor (batched per
        group, max_abs), cast to the destination dtype. Casting rounds monotonically,
        so the largest magnitude overflows the destination exactly when some element does."""
        for group in self.finite:  # one group (and one host sync) unless devices or dtypes differ
            norms = max_abs([reducible(tensors[i]) for i in group.positions])
            if not bool(torch.isfinite(norms.to(group.dst_dtype)).all()):
                self._refuse(tensors)

    def _refuse(self, tensors: Sequence[torch.Tensor]) -> None:
        """The per-tensor check, which names the culprits."""
        name_at = dict(zip(self.positions, self.names))
        entries = [(i, g.dst_dtype) for g in self.finite for i in g.positions]
        refuse_nonfinite([(name_at[i], tensors[i]) for i, _ in entries], [d for _, d in entries])
        raise AssertionError("the batched finite check and the per-tensor one disagree")


def _is_whole(src: torch.Tensor, full: torch.Tensor) -> bool:
    """Whether `src` is `full` itself (a narrow that kept everything)."""
    return src.data_ptr() == full.data_ptr() and src.shape == full.shape and src.stride() == full.stride()


@torch.no_grad()
def load_tensors(
    model: nn.Module, named: list[tuple[str, torch.Tensor]], *, check_finite: bool = True
) -> int:
    """Validate every (name, tensor), then load them all. Returns how many were loaded.
    `check_finite`: refuse a set holding NaN or inf (on by default; one batched reduction).
    The WeightManager caches the plan per signature; this builds it afresh."""
    return TensorPlan.build(model, named).run([t for _, t in named], check_finite)


# -- model construction ----------------------------------------------------------------------------
def build_model(cls: type[nn.Module], config: Any, **kwargs: Any) -> nn.Module:
    """`cls(config, **kwargs)` with every parameter a view of one uninitialised uint8 storage,
    `model.weight_storage`: one allocation instead of one per parameter, nothing written before the
    weights are loaded, and a bucket packed in storage order loads as one copy (weights/plan.py)."""
    with deferred_params():
        model = cls(config, **kwargs)
    place_params(model, kwargs["device"])
    return model


def place_params(model: nn.Module, device: torch.device | str) -> None:
    """Replace the (meta) parameters by views of one new storage on `device`; tied parameters stay tied."""
    params = list(model.parameters())  # each shared parameter once
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // PARAM_ALIGN) * PARAM_ALIGN
    storage = torch.empty(max(total, PARAM_ALIGN), dtype=torch.uint8, device=device)
    placed = {
        id(p): nn.Parameter(
            storage[o : o + p.numel() * p.element_size()].view(p.dtype).view(p.shape), requires_grad=False
        )
        for p, o in zip(params, offsets)
    }
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = placed[id(p)]
    model.weight_storage = storage


# -- checkpoints on disk ---------------------------------------------------------------------------
def safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        return [path / f for f in sorted(set(_weight_map(index).values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {str(path)!r}")
    return files


def weight_files(path: str | Path) -> list[Path]:
    """The checkpoint's weight files: safetensors when the folder has them, else pytorch_model.bin
    (one file, or the shards its index names), read by `read_bin`."""
    path = Path(path)
    if (path / INDEX_FILE).exists() or any(path.glob("*.safetensors")):
        return safetensors_files(path)
    if (path / BIN_INDEX_FILE).exists():
        return [path / f for f in sorted(set(_weight_map(path / BIN_INDEX_FILE).values()))]
    if (path / BIN_FILE).exists():
        return [path / BIN_FILE]
    raise ValueError(f"model: no *.safetensors or {BIN_FILE} weights in {str(path)!r}")


def read_bin(f: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin state dict, unpickled with torch.load(weights_only=True): tensors and plain
    containers only, so a checkpoint cannot run code when it loads (memory-mapped where the file's
    format allows)."""
    import pickle

    try:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # the legacy (pre-zip) format cannot be memory-mapped
            if "mmap" not in str(e):
                raise
            state = torch.load(f, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as e:
        raise ValueError(
            f"checkpoint file {str(f)!r} is not a readable weights-only torch file: {e}"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"checkpoint file {str(f)!r} does not hold a state dict of tensors")
    return state


def _weight_map(index: Path) -> dict[str, str]:
    """The index's weight_map, each file name checked to be a plain relative path inside the folder."""
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint index {str(index)!r} is not readable JSON: {e}") from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(
            f"checkpoint index {str(index)!r}: 'weight_map' is missing or not a non-empty object"
        )
    for name, file in weight_map.items():
        # checked by name, not by resolving: in a Hugging Face cache the files are symlinks to blobs
        # outside the snapshot folder, which is fine; a name that climbs out of it is not
        where = PurePosixPath(file) if isinstance(file, str) and file and "\\" not in file else None
        if where is None or where.is_absolute() or ".." in where.parts:
            raise ValueError(
                f"checkpoint index {str(index)!r}: 'weight_map' entry {name!r} -> {file!r} "
                "is not a file name inside the checkpoint folder"
            )
    return weight_map


def checkpoint_specs(files: list[Path]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor, read from the headers alone (safetensors checks there that
    the data covers the file, so a truncated file fails here, before any write); a .bin file has no
    header apart from its data, so it is unpickled (memory-mapped: the bytes are read on the copy)."""
    specs = []
    for f in files:
        if f.suffix == ".bin":
            specs += [(name, tuple(t.shape), t.dtype) for name, t in read_bin(f).items()]
            continue
        with _open(f) as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                dtype = parse_dtype(sl.get_dtype(), f"checkpoint file {str(f)!r}: dtype of {name!r}")
                specs.append((name, tuple(sl.get_shape()), dtype))
    return specs


def _open(f: Path, device: str | torch.device = "cpu") -> Any:
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(f), framework="pt", device=str(device))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"checkpoint file {str(f)!r} is not a readable safetensors file: {e}") from e


def iter_checkpoint(
    files: list[Path], device: str | torch.device = "cpu", only: Container[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor, or of those in `only` (the others are never read)."""
    for f in files:
        if f.suffix == ".bin":
            yield from ((n, t.to(device)) for n, t in read_bin(f).items() if only is None or n in only)
            continue
        with _open(f, device) as sf:
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
    check_finite: bool = True,
    fresh: bool = False,
) -> int:
    """Load a HF checkpoint folder after validating every tensor's name/shape/dtype from the headers.
    `keep(name)` selects the tensors to load (a partial update); every header is still validated.
    `check_finite` reads the tensors once more before the first write, to refuse NaN or inf; for a
    `fresh` model (no weights yet to keep intact) the check runs on the loaded weights instead."""
    files = weight_files(path)
    targets = {t.name: t for t in resolve_all(model, checkpoint_specs(files)) if t is not None}
    if keep is not None:
        targets = {n: t for n, t in targets.items() if keep(n)}
    if require_all:
        missing = [n for n in model.hf_names() if n not in targets]
        if missing:
            raise ValueError(f"checkpoint {str(path)!r} lacks {len(missing)} weights, e.g. {missing[:3]}")
    if check_finite and not fresh:
        for name, tensor in iter_checkpoint(files, only=targets):
            refuse_nonfinite([(name, tensor)])
    copy_parallel((targets[name], tensor) for name, tensor in iter_checkpoint(files, only=targets))
    if check_finite and fresh:
        refuse_nonfinite([(name, t.read()) for name, t in targets.items()])
    return len(targets)


def copy_parallel(work: Iterable[tuple[WeightTarget, torch.Tensor]]) -> None:
    """Load each (target, tensor) on LOAD_THREADS threads. safetensors hands out tensors that map the
    file, so the copy is also the read (page faults), and copy_ runs without the interpreter lock: the
    threads read different tensors at once. The tensors are opened here, on one thread."""
    if LOAD_THREADS <= 1:
        for target, tensor in work:
            target.load(tensor)
        return
    with ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="rollout-load") as pool:
        for done in [pool.submit(target.load, tensor) for target, tensor in work]:
            done.result()  # raises the first failure
