"""Qwen3.5 and Qwen3-Next: hybrid decoders of Gated DeltaNet (linear attention) and gated full attention.

`layer_types` says which mixer each layer has (three "linear_attention" to one "full_attention" in the
published models). As transformers computes them (modeling_qwen3_5.py / modeling_qwen3_next.py):
- every RMSNorm but the DeltaNet output norm is zero-centred: x_hat * (1 + w), rounded once at the end;
- full attention: q_proj gives per head (query | gate); q and k get per-head norms, then RoPE on the first
  partial_rotary_factor of each head; the output is multiplied by sigmoid(gate) before o_proj;
- Gated DeltaNet: q, k, v from one projection go through a short causal conv + SiLU, then the gated delta
  rule (layers/gated_delta.py) with beta = sigmoid(b), decay g = -exp(A_log) softplus(a + dt_bias);
  its output is normalised per head and gated by SiLU(z) (plain weight), then out_proj.
Qwen3.5 projects q|k|v, z, b and a separately; Qwen3-Next packs them per key-head group
(in_proj_qkvz, in_proj_ba). The DeltaNet layers keep a per-request state (conv inputs, recurrent
matrix) declared by `state_shapes`, which the engine keeps in a pool beside the KV pages
(rollout/cache/state.py). Checkpoint names are the checkpoint's own; `Qwen3_5ForConditionalGeneration`
checkpoints hold the text tower under `model.language_model.` (the vision tower and the MTP head are
skipped).

Mixture of experts (models/sparse.py, layers/moe.py): Qwen3-Next-80B-A3B and Qwen3.5-MoE (35B-A3B,
122B-A10B, 397B-A17B) swap the dense MLP for a sparse block with a shared expert behind a sigmoid gate.
Qwen3-Next's layers are sparse by the Qwen-MoE rule (`mlp_only_layers`, `decoder_sparse_step`) and its
router renormalises when `norm_topk_prob`; Qwen3.5-MoE's layers are all sparse and its router always
renormalises (transformers' Qwen3_5MoeTopKRouter has no switch). Experts load from either checkpoint
layout; routes (R3) are recorded like Qwen3-MoE's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rollout.attention.base import ForwardContext
from rollout.distributed import SINGLE, TPGroup
from rollout.layers import fused, gated_delta, short_conv
from rollout.layers.embedding import LMHead, VocabEmbedding
from rollout.layers.fused import use_fused
from rollout.layers.linear import RowLinear, empty_param
from rollout.layers.moe import MoeSpec
from rollout.layers.packed import Packed
from rollout.models import naming
from rollout.models.config import ModelConfig, rope_parameters, rope_type
from rollout.models.llama import FUSED, MLP
from rollout.models.llama import LORA_TARGETS as LLAMA_LORA_TARGETS
from rollout.models.sparse import ExpertNames, feed_forward, run_feed_forward

SKIPPED_PREFIXES = ("mtp.", "model.visual.")  # multi-token prediction head, vision tower
# the Hugging Face modules a LoRA adapter may target (the ones this model has; "all-linear": all of them)
LORA_TARGETS = (
    *LLAMA_LORA_TARGETS,  # the gated attention's q/k/v/o and the MLP's
    *("out_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba"),
)
BARE = ("dt_bias", "A_log")  # parameters named without a ".weight" (kept in a Packed holder each)
GATED_MLPS = ("mlp", "shared_expert")  # whose gate_proj / up_proj load into one fused gate_up_proj


class ZeroCentredRMSNorm(nn.Module):
    """x_hat * (1 + w) in float32, one rounding to x's dtype (transformers' Qwen3_5RMSNorm)."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = empty_param(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            if use_fused(x):
                return fused.add_rms_norm(x, residual, self.weight, self.eps, centred=True)
            s = x + residual
            return self.forward(s), s
        if use_fused(x):  # one kernel instead of nine (layers/fused.py)
            return fused.rms_norm(x, self.weight, self.eps, centred=True)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def hf_shape(self, param: str, shard: None) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def copy_pair(self, param: str, shard: None, full: torch.Tensor):
        return self.weight.data, full

    def load(self, param: str, shard: None, full: torch.Tensor) -> None:
        self.weight.data.copy_(full)

    def read(self, param: str, shard: None) -> torch.Tensor:
        return self.weight.data


class GatedRMSNorm(ZeroCentredRMSNorm):
    """The DeltaNet output norm: w * x_hat (rounded to x's dtype first), times SiLU(gate) in float32."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor):  # type: ignore[override]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


def partial_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """RoPE (neox layout) on the first cos_sin.shape[-1] dims of each head; the rest pass through."""
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin.unsqueeze(1).to(x.dtype).chunk(2, dim=-1)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rotated, x_pass], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_layer: int, tp: TPGroup, dtype, device):
        super().__init__()
        hf, D = cfg.hf_config, cfg.head_dim
        self.kv_layer, self.head_dim = kv_layer, D
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_key_value_heads")
        bias = bool(getattr(hf, "attention_bias", False))
        if bias:
            raise ValueError("attention_bias=True is not supported for this architecture")
        kw = dict(tp=tp, dtype=dtype, device=device)
        self.q_proj = Packed([cfg.num_heads * D * 2], (cfg.hidden_size,), what="num_attention_heads", **kw)
        self.k_proj = Packed([cfg.num_kv_heads * D], (cfg.hidden_size,), what="num_key_value_heads", **kw)
        self.v_proj = Packed([cfg.num_kv_heads * D], (cfg.hidden_size,), what="num_key_value_heads", **kw)
        self.o_proj = RowLinear(cfg.num_heads * D, cfg.hidden_size, bias=False, **kw)
        self.q_norm = ZeroCentredRMSNorm(D, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = ZeroCentredRMSNorm(D, cfg.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor, cos_sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T, D, H, Hkv = h.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        q, gate = self.q_proj(h).view(T, H, 2 * D).chunk(2, dim=-1)
        q = partial_rope(self.q_norm(q), cos_sin)
        k = partial_rope(self.k_norm(self.k_proj(h).view(T, Hkv, D)), cos_sin)
        v = self.v_proj(h).view(T, Hkv, D)
        o = ctx.backend.forward(q.contiguous(), k.contiguous(), v, self.kv_layer, ctx.meta)
        return self.o_proj(o.reshape(T, H * D) * torch.sigmoid(gate.reshape(T, H * D)))


class GatedDeltaNet(nn.Module):
    """Linear attention with a per-request state (slot `state_layer` of the pool's "conv"/"recurrent")."""

    packed_qkvz = False  # Qwen3-Next: one in_proj_qkvz and one in_proj_ba, grouped by key head

    def __init__(self, cfg: ModelConfig, state_layer: int, tp: TPGroup, dtype, device):
        super().__init__()
        hf = cfg.hf_config
        self.state_layer = state_layer
        self.Hk = tp.shard(hf.linear_num_key_heads, "linear_num_key_heads")
        self.Hv = tp.shard(hf.linear_num_value_heads, "linear_num_value_heads")
        self.Dk, self.Dv = hf.linear_key_head_dim, hf.linear_value_head_dim
        Hk, Hv = hf.linear_num_key_heads, hf.linear_num_value_heads
        kd, vd, K = Hk * self.Dk, Hv * self.Dv, hf.linear_conv_kernel_dim
        self.conv_kernel = K
        kw = dict(tp=tp, dtype=dtype, device=device)
        hidden = (cfg.hidden_size,)
        if self.packed_qkvz:
            r = Hv // Hk
            self.in_proj_qkvz = Packed(
                [Hk * (2 * self.Dk + 2 * r * self.Dv)], hidden, what="linear_num_key_heads", **kw
            )
            self.in_proj_ba = Packed([Hk * 2 * r], hidden, what="linear_num_key_heads", **kw)
        else:
            self.in_proj_qkv = Packed([kd, kd, vd], hidden, what="linear attention heads", **kw)
            self.in_proj_z = Packed([vd], hidden, what="linear_num_value_heads", **kw)
            self.in_proj_b = Packed([Hv], hidden, what="linear_num_value_heads", **kw)
            self.in_proj_a = Packed([Hv], hidden, what="linear_num_value_heads", **kw)
        self.conv1d = Packed([kd, kd, vd], (1, K), what="linear attention heads", **kw)
        self.dt_bias = Packed([Hv], (), what="linear_num_value_heads", **kw)
        self.A_log = Packed([Hv], (), what="linear_num_value_heads", **kw)
        self.norm = GatedRMSNorm(self.Dv, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.out_proj = RowLinear(vd, cfg.hidden_size, bias=False, **kw)

    def project(self, h: torch.Tensor):
        """(q|k|v for the conv [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        T = h.shape[0]
        if not self.packed_qkvz:
            z = self.in_proj_z(h).view(T, self.Hv, self.Dv)
            return self.in_proj_qkv(h), z, self.in_proj_b(h), self.in_proj_a(h)
        r = self.Hv // self.Hk
        qkvz = self.in_proj_qkvz(h).view(T, self.Hk, -1)
        q, k, v, z = qkvz.split([self.Dk, self.Dk, r * self.Dv, r * self.Dv], dim=-1)
        b, a = self.in_proj_ba(h).view(T, self.Hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return qkv, z.reshape(T, self.Hv, self.Dv), b.reshape(T, self.Hv), a.reshape(T, self.Hv)

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T, st = h.shape[0], ctx.state
        qkv, z, b, a = self.project(h)
        conv_w = self.conv1d.weight.squeeze(1)
        conv_pool = st.pool.layer("conv", self.state_layer)
        rec_pool = st.pool.layer("recurrent", self.state_layer)
        if st.decode:
            x = short_conv.decode(qkv, conv_w, conv_pool, st.slots)
        else:
            x = short_conv.prefill(qkv, conv_w, conv_pool, st.slots, st.fresh, st.q_lens)
        kd = self.Hk * self.Dk
        q, k, v = x.split([kd, kd, self.Hv * self.Dv], dim=-1)
        q, k, v = q.view(T, self.Hk, self.Dk), k.view(T, self.Hk, self.Dk), v.view(T, self.Hv, self.Dv)
        beta = b.sigmoid()
        g = -self.A_log.weight.float().exp() * F.softplus(a.float() + self.dt_bias.weight)
        if st.decode:
            o = gated_delta.decode(q, k, v, g, beta, rec_pool, st.slots)
        else:
            o = gated_delta.prefill(q, k, v, g, beta, rec_pool, st.slots, st.fresh, st.q_lens, st.cu_seqlens)
        o = self.norm(o, z)
        return self.out_proj(o.reshape(T, self.Hv * self.Dv))


class NextGatedDeltaNet(GatedDeltaNet):
    packed_qkvz = True


class HybridLayer(nn.Module):
    def __init__(self, cfg, kind: str, index: int, tp, dtype, device, deltanet, layer: int, spec):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = deltanet(cfg, index, tp, dtype, device)
        elif kind == "full_attention":
            self.self_attn = GatedAttention(cfg, index, tp, dtype, device)
        else:
            raise ValueError(
                f"layer_types entry {kind!r} is not supported (linear_attention, full_attention)"
            )

        def dense() -> nn.Module:
            return MLP(cfg, tp, dtype, device)

        self.mlp = feed_forward(cfg, spec, layer, dense, tp=tp, dtype=dtype, device=device)
        eps = cfg.rms_norm_eps
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, eps, dtype=dtype, device=device)

    def forward(self, h, residual, cos_sin, ctx):
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        mixed = (
            self.linear_attn(h, ctx) if self.kind == "linear_attention" else self.self_attn(h, cos_sin, ctx)
        )
        h, residual = self.post_attention_layernorm(mixed, residual)
        return run_feed_forward(self.mlp, h, ctx), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp, dtype, device, max_positions: int, deltanet, spec):
        super().__init__()
        hf = cfg.hf_config
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype, device=device)
        counters = {"linear_attention": 0, "full_attention": 0}
        layers = []
        for i, kind in enumerate(hf.layer_types[: cfg.num_layers]):
            layers.append(HybridLayer(cfg, kind, counters.get(kind, 0), tp, dtype, device, deltanet, i, spec))
            counters[kind] = counters.get(kind, 0) + 1
        self.layers = nn.ModuleList(layers)
        self.num_linear, self.num_full = counters["linear_attention"], counters["full_attention"]
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.register_buffer("cos_sin", rope_table(cfg, max_positions, device), persistent=False)


def rope_table(cfg: ModelConfig, max_positions: int, device) -> torch.Tensor:
    """[max_positions, rotary_dim]: cos half | sin half, as transformers' default RoPE with a partial
    rotary factor (text positions: the three M-RoPE sections all see the same position)."""
    params = rope_parameters(cfg.hf_config)
    if rope_type(params) != "default":
        raise ValueError(f"rope_type {rope_type(params)!r} is not supported for {cfg.architecture}")
    dim = int(cfg.head_dim * params.get("partial_rotary_factor", 1.0))
    inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv.to(device))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class HybridForCausalLM(nn.Module):
    """The decoder and its dense weights' names; the registered classes add the experts' names."""

    deltanet = GatedDeltaNet
    hf_prefix = "model."  # where the checkpoint keeps the text model
    renormalise_top_k: bool | None = None  # the router's rule when transformers hard-codes it

    def __init__(self, cfg: ModelConfig, *, dtype, device, max_positions: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.config, self.tp, self.dtype = cfg, tp, dtype
        check_supported(cfg)
        self._resolved: dict[str, Any] = {}
        self.model = Backbone(cfg, tp, dtype, device, max_positions, self.deltanet, self.moe_spec(cfg))
        if cfg.tie_word_embeddings:
            self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype, device=None)
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype, device=device)

    def moe_spec(self, cfg: ModelConfig) -> MoeSpec | None:
        if cfg.moe is None or self.renormalise_top_k is None:
            return cfg.moe
        return replace(cfg.moe, norm_topk_prob=self.renormalise_top_k)

    # -- what the engine sizes around the model --------------------------------------------------------
    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache (the full-attention ones)."""
        return self.model.num_full

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The per-request state of the DeltaNet layers: the conv's last K-1 inputs (model dtype) and the
        recurrent matrix (float32, as the kernels accumulate it)."""
        layer = next(m.linear_attn for m in self.model.layers if m.kind == "linear_attention")
        channels = 2 * layer.Hk * layer.Dk + layer.Hv * layer.Dv
        n = self.model.num_linear
        return {
            "conv": ((n, channels, layer.conv_kernel - 1), self.dtype),
            "recurrent": ((n, layer.Hv, layer.Dk, layer.Dv), torch.float32),
        }

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cos_sin = self.model.cos_sin[positions]
        h, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            h, residual = layer(h, residual, cos_sin, ctx)
        return self.model.norm(h, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden).float()

    # -- weights by Hugging Face name ------------------------------------------------------------------
    def resolve(self, hf_name: str):
        if hf_name not in self._resolved:
            self._resolved[hf_name] = self._resolve(hf_name)
        return self._resolved[hf_name]

    def _resolve(self, hf_name: str):
        if hf_name.startswith(SKIPPED_PREFIXES) or hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name == "lm_head.weight":
            return (
                (self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head),
                "weight",
                None,
            )
        if not hf_name.startswith(self.hf_prefix):
            raise ValueError(f"unknown weight name {hf_name!r} for {self.config.architecture}")
        *path, mod, param = ["model", *hf_name[len(self.hf_prefix) :].split(".")]
        shard = None
        if param in BARE:
            path, mod, param = [*path, mod], param, "weight"
        elif path and path[-1] in GATED_MLPS and mod in FUSED:
            mod, shard = FUSED[mod]
        return naming.loadable(self, hf_name, ".".join([*path, mod]), param, shard)

    def hf_names(self) -> list[str]:
        return naming.hf_names(self, FUSED, self.hf_prefix, BARE)

    def lora_modules(self) -> dict[str, tuple[nn.Module, Any]]:
        return naming.modules_named(self, FUSED, LORA_TARGETS, self.hf_prefix)


class Qwen3_5ForCausalLM(ExpertNames, HybridForCausalLM):
    """Qwen3.5 (dense MLP, or the experts wherever the config has them)."""


class Qwen3_5TextOfConditionalGeneration(Qwen3_5ForCausalLM):
    """The text tower of a `Qwen3_5ForConditionalGeneration` checkpoint (images are not supported)."""

    hf_prefix = "model.language_model."


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    deltanet = NextGatedDeltaNet


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    renormalise_top_k = True


class Qwen3_5MoeTextOfConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The text tower of a `Qwen3_5MoeForConditionalGeneration` checkpoint (images are not supported)."""

    hf_prefix = "model.language_model."


def check_supported(cfg: ModelConfig) -> None:
    hf = cfg.hf_config
    if "linear_attention" not in hf.layer_types[: cfg.num_layers]:
        raise ValueError(f"{cfg.architecture}: layer_types has no linear_attention layer")
