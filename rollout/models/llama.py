"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), switched by ModelConfig flags, not by subclass.

Shapes: T = new tokens in the step (all requests concatenated), H* = heads on this TP rank, D = head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rollout.attention.base import ForwardContext
from rollout.distributed import SINGLE, TPGroup
from rollout.layers import fused
from rollout.layers.embedding import LMHead, VocabEmbedding
from rollout.layers.fused import use_fused
from rollout.layers.linear import ColumnLinear, RowLinear
from rollout.layers.mlp import GatedMLP
from rollout.layers.norm import RMSNorm
from rollout.layers.rotary import Rotary
from rollout.models import naming
from rollout.models.config import ModelConfig

# HF parameter module -> (our fused module, shard inside it)
FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# the Hugging Face modules a LoRA adapter may target ("all-linear": all of them)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# checkpoint entries that carry no weights of ours (old checkpoints saved rotary buffers)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype, device):
        super().__init__()
        D = cfg.head_dim
        self.layer, self.head_dim = layer, D
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_key_value_heads")
        kv_out = cfg.num_kv_heads * D
        self.qkv_proj = ColumnLinear(
            cfg.hidden_size,
            [cfg.num_heads * D, kv_out, kv_out],
            bias=cfg.qkv_bias,
            shard_names=["q", "k", "v"],
            tp=tp,
            dtype=dtype,
            device=device,
        )
        self.o_proj = RowLinear(
            cfg.num_heads * D, cfg.hidden_size, bias=cfg.o_bias, tp=tp, dtype=dtype, device=device
        )
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, device=device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, device=device) if cfg.qk_norm else None

    def forward(self, h: torch.Tensor, cos_sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        D, Hq, Hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = self.qkv_proj(h).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.view(-1, Hq, D), k.view(-1, Hkv, D), v.view(-1, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if use_fused(q):  # both rotations in one kernel (see layers/fused.py)
            q, k = fused.rope(q, k, cos_sin)
        else:
            q, k = rope(q, cos_sin), rope(k, cos_sin)
        o = ctx.backend.forward(q, k, v, self.layer, ctx.meta)  # [T, Hq, D]
        return self.o_proj(o.reshape(-1, Hq * D))


def rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D], cos_sin: [T, D] (cos half | sin half); neox layout like HF
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class MLP(GatedMLP):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device):
        super().__init__(
            cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, tp=tp, dtype=dtype, device=device
        )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype, device):
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp, dtype, device)
        self.mlp = self.make_mlp(cfg, layer, tp, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)

    def make_mlp(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype, device) -> nn.Module:
        """This layer's feed-forward block (a subclass swaps in a sparse one)."""
        return MLP(cfg, tp, dtype, device)

    def attend(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed input of the feed-forward block, the residual stream before it)."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        return self.post_attention_layernorm(self.self_attn(h, cos_sin, ctx), residual)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next norm adds them."""
        h, residual = self.attend(h, residual, cos_sin, ctx)
        return self.mlp(h), residual


class Backbone(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        device,
        max_positions: int,
        layer_class: type[DecoderLayer] = DecoderLayer,
    ):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype, device=device)
        self.layers = nn.ModuleList(layer_class(cfg, i, tp, dtype, device) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.rotary = Rotary(cfg.head_dim, max_positions, device=device, hf_config=cfg.hf_config)


class LlamaForCausalLM(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer  # a model family with other blocks sets its own

    def __init__(
        self, cfg: ModelConfig, *, dtype: torch.dtype, device, max_positions: int, tp: TPGroup = SINGLE
    ):
        super().__init__()
        self.config, self.tp = cfg, tp
        self._resolved: dict[str, tuple[nn.Module, str, Any] | None] = {}
        self.model = Backbone(cfg, tp, dtype, device, max_positions, self.layer_class)
        if cfg.tie_word_embeddings:
            self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype, device=None)
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        cos_sin = self.model.rotary.cos_sin[positions]
        h, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            h, residual = layer(h, residual, cos_sin, ctx)
        return self.model.norm(h, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head.logits(hidden).float()

    # -- weights by Hugging Face name ---------------------------------------------------------------
    def resolve(self, hf_name: str) -> tuple[nn.Module, str, Any] | None:
        """The (module, parameter, shard) a HF parameter name loads into; None for ignorable entries.
        Remembered per name: a trainer sends the same few hundred names at every sync."""
        if hf_name not in self._resolved:
            self._resolved[hf_name] = self._resolve(hf_name)
        return self._resolved[hf_name]

    def _resolve(self, hf_name: str) -> tuple[nn.Module, str, Any] | None:
        if hf_name.endswith(IGNORED_SUFFIXES):
            return None
        if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return self.model.embed_tokens, "weight", None
        if hf_name.count(".") < 1:
            raise ValueError(f"unknown weight name {hf_name!r} for {self.config.architecture}")
        *path, mod, param = hf_name.split(".")
        mod, shard = FUSED.get(mod, (mod, None))
        return naming.loadable(self, hf_name, ".".join([*path, mod]), param, shard)

    def hf_names(self) -> list[str]:
        """Every HF parameter name this model needs loaded (one entry per shard of a fused parameter)."""
        return naming.hf_names(self, FUSED)

    def lora_modules(self) -> dict[str, tuple[nn.Module, Any]]:
        """HF module path -> (our module, shard) of every module a LoRA adapter may target."""
        return naming.modules_named(self, FUSED, LORA_TARGETS)
