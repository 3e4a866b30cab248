"""Rotary position embedding (neox layout, as in HF Llama/Qwen), with frequencies from transformers.

The inverse frequencies and the cos/sin scale (yarn's and longrope's attention factor) come from
transformers' own RoPE initialisation functions, fed the model's transformers config: every rope type
and config field the installed transformers knows is then handled exactly as the trainer's model
handles it (only the plain "default" formula is written out, see default_rope). The table is fixed, so
rope types whose frequencies transformers recomputes from the sequence length (dynamic, longrope) are
accepted only over the positions where they do not change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_init_function(kind: str):
    """transformers' function computing (inv_freq, attention_factor) for this rope type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind in ROPE_INIT_FUNCTIONS:  # transformers 4 lists "default" here too
        return ROPE_INIT_FUNCTIONS[kind]
    if kind == "default":
        return default_rope
    known = ", ".join(["default", *ROPE_INIT_FUNCTIONS])
    raise ValueError(f"rope_type {kind!r} is not supported by this transformers (known: {known})")


def default_rope(hf_config: Any, *_, **__) -> tuple[torch.Tensor, float]:
    """transformers 5's `compute_default_rope_parameters`, the same static method in each supported
    model's rotary class (tests/test_rope_config.py holds them equal): written out here because
    importing a modeling file to reach it costs seconds at every engine start."""
    base = rope_parameters(hf_config)["rope_theta"]
    dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def fixed_up_to(hf_config: Any, params: dict[str, Any], kind: str) -> int | None:
    """The positions over which transformers keeps a length-dependent rope type's frequencies fixed."""
    if kind == "dynamic":  # rescaled once a sequence grows past max_position_embeddings
        return hf_config.max_position_embeddings
    if kind == "longrope":  # short factors up to the original context, long factors (everywhere) past it
        return params.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
    return None


def rope_frequencies(hf_config: Any, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, cos/sin scale) as transformers computes them for this config."""
    params = rope_parameters(hf_config)
    kind = rope_type(params)
    limit = fixed_up_to(hf_config, params, kind)
    if limit is not None and max_positions > limit:
        raise ValueError(
            f"rope_type {kind!r}: transformers changes the frequencies once a sequence passes {limit} "
            f"positions, which a fixed table cannot follow; set max_model_len <= {limit} "
            f"(asked for {max_positions})"
        )
    inv, scale = rope_init_function(kind)(hf_config)
    if inv.numel() != head_dim // 2:  # e.g. partial_rotary_factor < 1: rotation of part of each head
        rotated = 2 * inv.numel()
        raise ValueError(f"rope rotates {rotated} of {head_dim} head dims; only full rotation is supported")
    return inv.float().cpu(), float(scale)


def standalone_config(head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int) -> Any:
    """A one-head transformers config holding just these RoPE settings."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=head_dim, num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim,
        intermediate_size=1, num_hidden_layers=1, vocab_size=1, max_position_embeddings=max_positions,
        bos_token_id=None, eos_token_id=None, rope_theta=theta,
        rope_scaling=dict(scaling) if scaling else None,
    )  # fmt: skip


class Rotary(nn.Module):
    """A cos/sin table for every position up to max_positions (float32, computed once), from
    `hf_config` (the model's transformers config) or else from `theta` and `scaling` alone."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float = 10000.0,
        scaling: dict[str, Any] | None = None,
        device=None,
        *,
        hf_config: Any = None,
    ):
        super().__init__()
        if hf_config is None:
            hf_config = standalone_config(head_dim, theta, scaling, max_positions)
        inv, scale = rope_frequencies(hf_config, head_dim, max_positions)
        self.inv_freq, self.attention_scaling = inv, scale
        # positions * inv_freq in float32 (one rounding each), then cos/sin on the device that runs the
        # model, as transformers' rotary forward does
        freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv.to(device))
        # cos_sin: [max_positions, head_dim] = cos half | sin half, both times the scale (yarn, longrope)
        cos_sin = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
        self.register_buffer("cos_sin", cos_sin, persistent=False)


def rope_parameters(hf: Any) -> dict[str, Any]:
    """The RoPE settings (with rope_theta) as this transformers version keeps them."""
    params = getattr(hf, "rope_parameters", None)  # transformers 5 (old spellings already folded in)
    if params is None:  # transformers 4: rope_theta beside an optional rope_scaling
        params = dict(getattr(hf, "rope_scaling", None) or {}, rope_theta=getattr(hf, "rope_theta", 10000.0))
    return params


def rope_type(params: dict[str, Any]) -> str:
    return params.get("rope_type") or params.get("type") or "default"
