"""Hugging Face weight names <-> the loadable modules of a model whose module tree mirrors its checkpoint's.

A model file says where a name points (its module path, parameter and shard) and how it renames the
checkpoint's modules (`fused`: HF module -> (our fused module, shard inside it)); the lookup, its checks
and the walk back from modules to names are the same for every such file, so they live here once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch import nn

Fused = Mapping[str, tuple[str, Any]]


def loadable(
    model: nn.Module, hf_name: str, module_path: str, param: str, shard: Any
) -> tuple[nn.Module, str, Any]:
    """(module, param, shard) when `module_path` is a loadable module holding `param` with that shard;
    else a ValueError naming `hf_name`."""
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        module = None
    if (
        module is None
        or not hasattr(module, "load")
        or getattr(module, param, None) is None
        or shard not in getattr(module, "shard_names", [None])  # e.g. our fused "qkv_proj"
    ):
        raise ValueError(f"unknown weight name {hf_name!r} for {model.config.architecture}")
    return module, param, shard


def hf_modules(model: nn.Module, fused: Fused, prefix: str = "model.") -> Iterator[tuple[nn.Module, list]]:
    """(module, [(HF module path, shard), ...]) for every loadable module of `model`: one path per shard
    of a fused module. Our top `model.` stands for the checkpoint's `prefix`."""
    fused_back = {v: k for k, v in fused.items()}
    top, tied = prefix.rstrip(".").split("."), model.config.tie_word_embeddings
    for mod_name, module in model.named_modules():
        if not hasattr(module, "load") or module is model.lm_head and tied:
            continue
        *path, last = mod_name.split(".")
        if path and path[0] == "model":
            path = [*top, *path[1:]]
        shards = getattr(module, "shard_names", [None])
        yield module, [(".".join([*path, fused_back.get((last, s), last)]), s) for s in shards]


def hf_names(model: nn.Module, fused: Fused, prefix: str = "model.", bare: Iterable[str] = ()) -> list[str]:
    """Every HF parameter name `model` needs loaded (one per shard of a fused module); a module named in
    `bare` is a parameter of its own (no ".weight")."""
    bare, names = set(bare), []
    for module, paths in hf_modules(model, fused, prefix):
        if paths[0][0].rsplit(".", 1)[-1] in bare:
            names.append(paths[0][0])
            continue
        for param in ("weight", "bias"):
            if getattr(module, param, None) is not None:
                names += [f"{path}.{param}" for path, _ in paths]
    return names


def modules_named(
    model: nn.Module, fused: Fused, leaves: Iterable[str], prefix: str = "model."
) -> dict[str, tuple[nn.Module, Any]]:
    """HF module path -> (our module, shard) for the modules whose HF name ends in one of `leaves`."""
    leaves = set(leaves)
    return {
        path: (module, shard)
        for module, paths in hf_modules(model, fused, prefix)
        for path, shard in paths
        if path.rsplit(".", 1)[-1] in leaves
    }
