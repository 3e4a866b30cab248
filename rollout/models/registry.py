"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

import importlib

from torch import nn

MODELS: dict[str, str] = {
    "LlamaForCausalLM": "rollout.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "rollout.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "rollout.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "rollout.models.llama:LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "rollout.models.qwen_moe:QwenMoeForCausalLM",
    "Qwen3MoeForCausalLM": "rollout.models.qwen_moe:QwenMoeForCausalLM",
    "Qwen3_5ForCausalLM": "rollout.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "rollout.models.qwen3_5:Qwen3_5TextOfConditionalGeneration",
    "Qwen3NextForCausalLM": "rollout.models.qwen3_5:Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM": "rollout.models.qwen3_5:Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "rollout.models.qwen3_5:Qwen3_5MoeTextOfConditionalGeneration",
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(MODELS)}")
    module, _, cls = MODELS[architecture].partition(":")
    return getattr(importlib.import_module(module), cls)
