"""Qwen2-MoE and Qwen3-MoE: the Llama-family decoder with sparse feed-forward blocks (layers/moe.py).

Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (per-head q/k norms), 128 experts, top-8,
renormalised top-k weights. Qwen2-MoE (Qwen1.5-MoE-A2.7B): Qwen2 attention (q/k/v biases), 60 experts,
top-4 without renormalisation, plus a shared expert behind a sigmoid gate. Layers in `mlp_only_layers`
(or off the `decoder_sparse_step` grid) keep a dense MLP. Expert weights load from either checkpoint
layout (models/sparse.py).
"""

from __future__ import annotations

import torch
from torch import nn

from rollout.attention.base import ForwardContext
from rollout.distributed import TPGroup
from rollout.models.config import ModelConfig
from rollout.models.llama import DecoderLayer, LlamaForCausalLM
from rollout.models.sparse import ExpertNames, feed_forward, run_feed_forward


class MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype, device) -> nn.Module:
        def dense() -> nn.Module:
            return super(MoeDecoderLayer, self).make_mlp(cfg, layer, tp, dtype, device)

        return feed_forward(cfg, cfg.moe, layer, dense, tp=tp, dtype=dtype, device=device)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.attend(h, residual, cos_sin, ctx)
        return run_feed_forward(self.mlp, h, ctx), residual


class QwenMoeForCausalLM(ExpertNames, LlamaForCausalLM):
    layer_class = MoeDecoderLayer
