"""The model facts the engine needs, read from a Hugging Face config.json the way transformers reads it.

The fields come from `transformers.AutoConfig`, so every default, legacy spelling (`rope_scaling` with
`type`, `torch_dtype`) and new field (`rope_parameters`, `layer_types`, `dtype`) resolves exactly as in
the trainer's model; only the facts transformers hard-codes per architecture (which projections carry
a bias, Qwen3's per-head norms) are spelled out here, as in its modeling files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.layers.moe import MoeSpec
from rollout.layers.rotary import rope_parameters, rope_type
from rollout.models.registry import MODELS

# Shape fields with no sensible default: a config.json without one is broken, not "default-sized"
# (transformers would silently fill in e.g. hidden_size=4096 and the weights would not fit).
REQUIRED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")  # fmt: skip
# ... but a mixture-of-experts config may have no dense MLP at all (Qwen3.5-MoE has no intermediate_size)
NOT_REQUIRED_WITH_EXPERTS = ("intermediate_size",)
QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


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
    rope_scaling: dict[str, Any] | None  # the rope parameters when the type is not "default"
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    moe: MoeSpec | None = None  # the sparse blocks' shape, for mixture-of-experts models
    moe_layers: tuple[int, ...] = ()  # the decoder layers whose feed-forward block is sparse
    # the transformers config itself: RoPE tables are computed from it by transformers' own functions
    hf_config: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        file = path / "config.json"
        raw = _read_json(file)
        check_fields(raw, str(file))
        gen_file = path / "generation_config.json"
        gen = _read_json(gen_file) if gen_file.exists() else {}
        from transformers import AutoConfig

        try:
            hf = AutoConfig.from_pretrained(str(path))
        except Exception as e:  # e.g. a model_type this transformers does not know
            raise ValueError(f"{file}: transformers cannot read this config: {e}") from e
        return cls.from_hf(hf, gen, source=str(file))

    @classmethod
    def from_dict(
        cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None, source: str = "config.json"
    ) -> ModelConfig:
        """The same as from_path for a config.json already read into a dict."""
        from transformers import AutoConfig

        check_fields(cfg, source)
        return cls.from_hf(AutoConfig.for_model(**cfg), generation or {}, source=source)

    @classmethod
    def from_hf(cls, hf: Any, generation: dict[str, Any], source: str = "config.json") -> ModelConfig:
        arch = hf.architectures[0]
        top, hf = hf, hf.get_text_config()  # the text model's config (itself for a text-only model)
        num_heads, num_kv_heads = hf.num_attention_heads, hf.num_key_value_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act={act!r} is not supported (the MLP is SiLU-gated)")
        params = rope_parameters(hf)
        kind = rope_type(params)
        # biases exactly where transformers' modeling files put them (Qwen2 hard-codes q/k/v biases;
        # Mistral has none, whatever the file says)
        attn_bias = bool(getattr(hf, "attention_bias", False)) and arch != "MistralForCausalLM"
        qwen2 = arch == "Qwen2ForCausalLM"
        moe, moe_layers = moe_spec(hf, source)
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=getattr(hf, "intermediate_size", None) or 0,  # 0: no dense MLP
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=float(params["rope_theta"]),
            rope_scaling=None if kind == "default" else dict(params, rope_type=kind),
            max_position_embeddings=hf.max_position_embeddings,
            # the checkpoint's own class reads it from its config: the top one of a vision-language model
            tie_word_embeddings=bool(getattr(top, "tie_word_embeddings", False)),
            # Qwen2-MoE reads `qkv_bias` (default true) and never biases o_proj
            qkv_bias=qwen2 or attn_bias or arch == "Qwen2MoeForCausalLM" and bool(hf.qkv_bias),
            o_bias=attn_bias and not qwen2,
            mlp_bias=arch == "LlamaForCausalLM" and bool(getattr(hf, "mlp_bias", False)),
            qk_norm=arch in QK_NORM,
            sliding_window=_sliding_window(hf, arch),
            eos_token_ids=_eos_ids(_first(hf, top, "eos_token_id"), generation),
            torch_dtype=_dtype_name(hf) or _dtype_name(top),
            moe=moe,
            moe_layers=moe_layers,
            hf_config=hf,
        )

    @property
    def tp_sizes(self) -> dict[str, int]:
        """The sizes tensor parallelism splits (the vocabulary is padded instead)."""
        sizes = {"num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads}
        if self.intermediate_size:
            sizes["intermediate_size"] = self.intermediate_size
        if self.moe is not None:
            sizes["moe_intermediate_size"] = self.moe.intermediate_size
            if self.moe.shared_intermediate_size:
                sizes["shared_expert_intermediate_size"] = self.moe.shared_intermediate_size
        return sizes


def moe_spec(hf: Any, source: str) -> tuple[MoeSpec | None, tuple[int, ...]]:
    """The experts' shape and the sparse layers, by transformers' Qwen-MoE rule: layer i is sparse
    unless it is in `mlp_only_layers`, when (i + 1) is a multiple of `decoder_sparse_step`."""
    experts = getattr(hf, "num_experts", None) or 0
    if not experts:
        return None, ()
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    layers = tuple(i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    try:
        spec = MoeSpec(
            num_experts=experts,
            top_k=hf.num_experts_per_tok,
            intermediate_size=hf.moe_intermediate_size,
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
            shared_intermediate_size=getattr(hf, "shared_expert_intermediate_size", 0) or 0,
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e
    return spec, layers


def check_fields(cfg: dict[str, Any], source: str) -> None:
    """A clear error for a config.json the engine cannot run: missing shape fields, unknown models."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"{source}: no 'architectures' entry; cannot tell which model to build")
    if archs[0] not in MODELS:
        raise ValueError(f"{source}: unsupported architecture {archs[0]!r}; supported: {sorted(MODELS)}")
    text = cfg.get("text_config") or cfg  # a vision-language checkpoint keeps its text model's shape there
    missing = [k for k in REQUIRED if cfg.get(k) is None and text.get(k) is None]
    if text.get("num_experts") or cfg.get("num_experts"):
        missing = [k for k in missing if k not in NOT_REQUIRED_WITH_EXPERTS]
    if missing:
        raise ValueError(f"{source}: missing required field(s) {missing} for {archs[0]}")


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise ValueError(f"{file}: not found")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _sliding_window(hf: Any, arch: str) -> int | None:
    """The attention window if any layer uses one (transformers' rule per architecture)."""
    if arch == "LlamaForCausalLM":
        return None  # Llama's attention has no window, whatever extra field a file carries
    if arch in QWEN and not getattr(hf, "use_sliding_window", False):
        return None  # Qwen files carry a sliding_window that applies only when switched on
    types = getattr(hf, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return getattr(hf, "sliding_window", None)


def _first(text: Any, top: Any, name: str) -> Any:
    """A field of the text config, else of the checkpoint's top config (vision-language checkpoints keep
    some at the top), else None."""
    value = getattr(text, name, None)
    return value if value is not None else getattr(top, name, None)


def _dtype_name(hf: Any) -> str | None:
    # transformers 5 reads `dtype` (and warns on `torch_dtype`); transformers 4 only has torch_dtype
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    return str(dtype).removeprefix("torch.") if dtype else None


def _eos_ids(config_eos: Any, gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (gen.get("eos_token_id"), config_eos):
        for i in src if isinstance(src, list) else [src]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)
