"""How large the engine is: the longest sequence the model allows, and the KV pool (from
max_total_tokens, or on a GPU from what the engine's share of the device leaves after the weights)."""

from __future__ import annotations

from typing import Any

import torch

from rollout.cache.pool import KVPool
from rollout.cache.routes import RouteStore
from rollout.cache.state import StatePool, StateShapes
from rollout.config import EngineConfig
from rollout.distributed import TPGroup
from rollout.models.config import ModelConfig

CPU_DEFAULT_TOKENS = 32768
GPU_RESERVE_BYTES = 2 << 30  # activations, logits, sampling and graph buffers beside weights and KV


def check_max_model_len(mc: ModelConfig, limit: int | None) -> int:
    """`limit` (max_model_len) checked against the model, or the model's own limit."""
    cap = mc.max_position_embeddings
    if mc.sliding_window:  # full attention equals sliding-window attention only inside the window
        cap = min(cap, mc.sliding_window)
    if limit is not None and limit > cap:
        raise ValueError(f"max_model_len={limit} exceeds what the model supports ({cap})")
    return limit or cap


def state_slots(cfg: EngineConfig) -> int:
    """State slots of a model with per-request state (cache/state.py): one per running request, and
    snapshots of shared prompts: one per prompt whose samples wait for its prefill, a quarter of the
    running requests (n >= 4 per prompt), at least 4."""
    n = cfg.max_running_requests
    return n + max(4, n // 4)


def state_shapes(model: torch.nn.Module) -> StateShapes | None:
    """The per-request state the model declares (linear-attention layers), None for a model without."""
    return model.state_shapes() if hasattr(model, "state_shapes") else None


def make_state_pool(cfg: EngineConfig, model: torch.nn.Module, device: torch.device) -> StatePool | None:
    shapes = state_shapes(model)
    return StatePool(shapes, state_slots(cfg), device) if shapes else None


def make_kv_pool(
    cfg: EngineConfig,
    mc: ModelConfig,
    tp: TPGroup,
    device: torch.device,
    dtype: torch.dtype,
    model: torch.nn.Module,
    lora: Any,
) -> KVPool:
    """The KV pool, its pages equal on the ranks of a tensor-parallel group."""
    kv_heads = tp.shard(mc.num_kv_heads, "num_key_value_heads")
    kv_layers = getattr(model, "num_kv_layers", mc.num_layers)  # hybrids: the attention layers only
    page_bytes = KVPool.bytes_per_page(kv_layers, cfg.page_size, kv_heads, mc.head_dim, dtype)
    if cfg.max_total_tokens is not None:
        num_pages = -(-cfg.max_total_tokens // cfg.page_size)
    elif device.type == "cuda":
        # the engine's own share of the device (weights, KV, graphs), never more than is free now:
        # a trainer or another engine in the process may hold the rest
        free, total = torch.cuda.mem_get_info(device)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
        weights += lora.nbytes if lora is not None else 0
        shapes = state_shapes(model)
        if shapes:  # the state slots come out of the same budget as the pages
            weights += StatePool.bytes_per_slot(shapes) * (state_slots(cfg) + 1)
        budget = min(total * cfg.mem_fraction - weights, free) - GPU_RESERVE_BYTES
        num_pages = int(budget // page_bytes) - 1  # the pool adds one scratch page
        if num_pages * cfg.page_size < 2 * cfg.page_size:
            raise ValueError(
                f"mem_fraction={cfg.mem_fraction} leaves no room for a KV cache "
                f"({weights / 2**30:.1f} GiB of weights, "
                f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB)"
            )
    else:
        num_pages = CPU_DEFAULT_TOKENS // cfg.page_size
    num_pages = tp.min_int(num_pages)  # ranks of a group must schedule over equal pools
    return KVPool(kv_layers, num_pages, cfg.page_size, kv_heads, mc.head_dim, dtype, device)


def make_route_store(
    cfg: EngineConfig, mc: ModelConfig, kv: KVPool, device: torch.device
) -> RouteStore | None:
    """The routed-experts store beside the KV cache, one row per KV slot (cache/routes.py), when
    enable_return_routed_experts asks for it."""
    if not cfg.enable_return_routed_experts:
        return None
    if mc.moe is None:
        raise ValueError(f"enable_return_routed_experts: {mc.architecture} has no mixture-of-experts layers")
    slots = (kv.num_pages + 1) * kv.page_size  # with the scratch page
    return RouteStore(slots, len(mc.moe_layers), mc.moe.top_k, mc.moe.num_experts, device)
