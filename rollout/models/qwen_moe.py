"""Qwen2-MoE and Qwen3-MoE: the Llama-family decoder with sparse feed-forward blocks (layers/moe.py).

Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (per-head q/k norms), 128 experts, top-8,
renormalised top-k weights. Qwen2-MoE (Qwen1.5-MoE-A2.7B): Qwen2 attention (q/k/v biases), 60 experts,
top-4 without renormalisation, plus a shared expert behind a sigmoid gate. Layers in `mlp_only_layers`
(or off the `decoder_sparse_step` grid) keep a dense MLP.

Expert weights load from either checkpoint layout: the hub's per-expert tensors
(`mlp.experts.N.gate_proj.weight`, `.up_proj.weight`, `.down_proj.weight`, what save_pretrained writes)
and transformers 5's fused parameters (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I], what a transformers 5 trainer's named_parameters() holds). The per-expert names are the
canonical ones (hf_names, checksums); a fused name `covers` all of its experts' names.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from rollout.attention.base import ForwardContext
from rollout.distributed import TPGroup
from rollout.layers.moe import PER_EXPERT, Experts, MoeBlock
from rollout.models.config import ModelConfig
from rollout.models.llama import DecoderLayer, LlamaForCausalLM

EXPERT_NAME = re.compile(
    r"^(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
FUSED_NAME = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<param>gate_up_proj|down_proj)$")


class MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype, device) -> nn.Module:
        if layer not in cfg.moe_layers:
            return super().make_mlp(cfg, layer, tp, dtype, device)
        block = MoeBlock(cfg.moe, cfg.hidden_size, tp=tp, dtype=dtype, device=device)
        block.route_index = cfg.moe_layers.index(layer)
        return block

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.attend(h, residual, cos_sin, ctx)
        if isinstance(self.mlp, MoeBlock):
            return self.mlp(h, routes=ctx.routes, valid=ctx.valid_rows), residual
        return self.mlp(h), residual


class QwenMoeForCausalLM(LlamaForCausalLM):
    layer_class = MoeDecoderLayer

    def _resolve(self, hf_name: str) -> tuple[nn.Module, str, Any] | None:
        m = EXPERT_NAME.match(hf_name)
        if m is None:
            return super()._resolve(hf_name)
        experts, e = self._experts(m["experts"], hf_name), int(m["e"])
        if e >= experts.num_experts:
            raise ValueError(
                f"unknown weight name {hf_name!r} for {self.config.architecture}: expert {e} of "
                f"num_experts={experts.num_experts}"
            )
        param, part = PER_EXPERT[m["proj"]]
        return experts, param, (part, e)

    def _experts(self, path: str, hf_name: str) -> Experts:
        try:
            module = self.get_submodule(path)
        except AttributeError:
            module = None
        if not isinstance(module, Experts):
            raise ValueError(f"unknown weight name {hf_name!r} for {self.config.architecture}")
        return module

    def hf_names(self) -> list[str]:
        """The dense names, and each expert's three tensors by the hub's per-expert names."""
        names = super().hf_names()
        for path, module in self.named_modules():
            if isinstance(module, Experts):
                names += [
                    f"{path}.{e}.{proj}.weight"
                    for e in range(module.num_experts)
                    for proj in ("gate_proj", "up_proj", "down_proj")
                ]
        return names

    def covers(self, hf_name: str) -> list[str]:
        """The canonical (hf_names) names that loading `hf_name` writes: itself, or for a fused experts
        parameter the per-expert names of every expert."""
        m = FUSED_NAME.match(hf_name)
        if m is None:
            return [hf_name]
        projs = ("gate_proj", "up_proj") if m["param"] == "gate_up_proj" else ("down_proj",)
        experts = self._experts(m["experts"], hf_name)
        return [f"{m['experts']}.{e}.{p}.weight" for e in range(experts.num_experts) for p in projs]
