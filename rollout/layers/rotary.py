"""Rotary position embedding (neox layout, as in HF Llama/Qwen), with Llama-3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    if kind == "llama3":
        return _llama3(inv, scaling)
    if kind == "linear":
        return inv / float(scaling["factor"])
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3, linear)")


def _llama3(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """A cos/sin table for every position up to max_positions (float32, computed once); see models.rope."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None, device=None
    ):
        super().__init__()
        inv = inverse_frequencies(head_dim, theta, scaling).to(device)
        freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv)
        # cos_sin: [max_positions, head_dim] = cos half | sin half
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
