"""Weights by the engine's own parameter names (SGLang's load_format="direct"): a trainer that fuses
q/k/v or gate/up itself sends `model.layers.0.self_attn.qkv_proj.weight` as the engine stores it (this
rank's shard under tensor parallelism). Validated whole before the first write, like every load."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from rollout.weights.loader import check_tensor, refuse_nonfinite

Named = Sequence[tuple[str, torch.Tensor]]


def direct_targets(model: nn.Module, named: Named) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """(parameter, tensor) per entry, after checking names, shapes, dtypes and values; raises with
    nothing written."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    pairs = []
    for name, t in named:
        if not isinstance(name, str) or name not in params:
            example = next(iter(params), "")
            raise ValueError(
                f"{name!r} is not a parameter of the engine's model (load_format='direct' takes the "
                f"engine's own names, e.g. {example!r})"
            )
        if name in seen:
            raise ValueError(f"weight {name!r} appears twice in one update")
        seen.add(name)
        check_tensor(name, t)
        p = params[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(t.shape)}, the engine stores {tuple(p.shape)}"
            )
        if not t.dtype.is_floating_point:
            raise TypeError(f"weight {name!r} has dtype {t.dtype}, expected a floating-point dtype")
        pairs.append((p, t))
    refuse_nonfinite(list(named), [p.dtype for p, _ in pairs])
    return pairs


@torch.no_grad()
def load_direct(model: nn.Module, named: Named) -> int:
    pairs = direct_targets(model, named)
    for p, t in pairs:
        p.copy_(t)
    return len(pairs)


@torch.no_grad()
def load_custom(model: nn.Module, loader: Callable[[nn.Module, list], Any], named: Named) -> None:
    """SGLang's custom_weight_loader: `loader(model, named_tensors)` writes what it will."""
    loader(model, list(named))


def hf_names_written(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The Hugging Face names whose storage the given names (the engine's own, or HF ones) cover: a
    fused parameter covers all of its shards."""
    names = set(names)
    params = dict(model.named_parameters())
    written = {id(params[n]) for n in names if n in params}
    out = []
    for hf in model.hf_names():
        found = model.resolve(hf)
        if hf in names or (found is not None and id(getattr(found[0], found[1])) in written):
            out.append(hf)
    return out
