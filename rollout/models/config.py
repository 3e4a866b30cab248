"""The model facts the engine needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot tell which model to build")
        arch = archs[0]
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        qwen2 = arch == "Qwen2ForCausalLM"
        window = cfg.get("sliding_window")
        if qwen2 and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)) and not qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
            eos_token_ids=_eos_ids(cfg, generation or {}),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "") or None,
        )

    @property
    def tp_sizes(self) -> dict[str, int]:
        """The sizes tensor parallelism splits (the vocabulary is padded instead)."""
        return {
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
        }

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.exists() else None
        return cls.from_dict(cfg, gen)


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 moved rope settings into `rope_parameters`; older files use rope_theta/rope_scaling
    return cfg.get("rope_parameters") or {}


def _rope_theta(cfg: dict[str, Any]) -> float:
    return float(_rope_params(cfg).get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or _rope_params(cfg)
    kind = scaling.get("rope_type") or scaling.get("type") if scaling else None
    if kind in (None, "default"):
        return None
    return dict(scaling, rope_type=kind)


def _eos_ids(cfg: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        for i in src if isinstance(src, list) else [src]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)
