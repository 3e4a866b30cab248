"""Attention backends by name, imported lazily so optional packages stay optional."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from rollout.attention.base import AttentionBackend

BACKENDS: dict[str, str] = {
    "torch": "rollout.attention.torch_native:TorchNativeBackend",
    "triton": "rollout.attention.triton_backend:TritonBackend",
    "flashinfer": "rollout.attention.flashinfer_backend:FlashInferBackend",
}


FLASHINFER_HEAD_DIMS = (64, 128, 256)


def resolve_backend_name(
    name: str, device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> str:
    if name not in (*BACKENDS, "auto"):
        raise ValueError(f"attention_backend must be one of {['auto', *BACKENDS]}, got {name!r}")
    if name != "auto":
        if name != "torch" and device.type != "cuda":
            raise ValueError(f"attention_backend={name!r} needs a CUDA device, the engine is on {device}")
        return name
    if device.type != "cuda":
        return "torch"
    # flashinfer has no float32 kernels, and its merge of split-KV states takes only some head dims
    fits = dtype in (None, torch.float16, torch.bfloat16) and head_dim in (None, *FLASHINFER_HEAD_DIMS)
    for candidate in ("flashinfer", "triton") if fits else ("triton",):
        if importlib.util.find_spec(candidate) is not None and _importable(BACKENDS[candidate].split(":")[0]):
            return candidate
    return "torch"


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:  # a broken optional install must not stop the engine
        return False


def backend_class(name: str) -> type[AttentionBackend]:
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
