"""A PEFT LoRA adapter's config (adapter_config.json, or the dict a trainer passes), checked once.

Only what the engine applies is accepted: plain LoRA on the decoder's linear layers, one rank and one
alpha for every module. Anything that would change the math silently (DoRA, rank patterns, a trained
bias, modules saved whole) is refused by name rather than ignored.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

# config keys whose non-default value means math the engine does not do
UNSUPPORTED = {
    "use_dora": (False, None),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "modules_to_save": (None, [], ()),
    "layers_to_transform": (None,),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "layer_replication": (None,),
    "target_parameters": (None, [], (), set()),  # PEFT leaves an empty set on MoE models
    "trainable_token_indices": (None,),
}


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    targets: frozenset[str]
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def parse(cls, config: Mapping[str, Any], supported: Collection[str]) -> AdapterConfig:
        """`supported`: the HF module names the model lets an adapter target ("all-linear" is all of them)."""
        if not isinstance(config, Mapping):
            raise TypeError(f"LoRA config must be a dict (adapter_config.json), got {type(config).__name__}")
        peft_type = config.get("peft_type", "LORA")
        if str(getattr(peft_type, "value", peft_type)).upper() != "LORA":
            raise ValueError(f"LoRA config: peft_type must be LORA, got {peft_type!r}")
        for key, defaults in UNSUPPORTED.items():
            if key in config and config[key] not in defaults:
                raise ValueError(f"LoRA config: {key}={config[key]!r} is not supported")
        rank = config.get("r", 8)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA config: r must be a positive int, got {rank!r}")
        alpha = config.get("lora_alpha", 8)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise ValueError(f"LoRA config: lora_alpha must be a finite number, got {alpha!r}")
        rslora = config.get("use_rslora", False)
        if not isinstance(rslora, bool):
            raise TypeError(f"LoRA config: use_rslora must be a bool, got {rslora!r}")
        return cls(rank, float(alpha), _targets(config.get("target_modules"), supported), rslora)


def _targets(value: Any, supported: Collection[str]) -> frozenset[str]:
    if value == "all-linear":  # PEFT: every linear layer but the output head
        return frozenset(supported)
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)) or not value:
        raise ValueError(
            f"LoRA config: target_modules must be a non-empty list of module names or 'all-linear' "
            f"(a regex is not supported), got {value!r}"
        )
    names = frozenset(str(v).rsplit(".", 1)[-1] for v in value)
    unknown = sorted(names - set(supported))
    if unknown:
        raise ValueError(
            f"LoRA config: target_modules {unknown} are not modules of this model an adapter may target "
            f"(supported: {sorted(supported)})"
        )
    return names
