"""A sparse mixture-of-experts block: router, fused experts, optional shared expert.

Interface (reused by every MoE family):
    spec = MoeSpec(num_experts, top_k, intermediate_size, norm_topk_prob, shared_intermediate_size)
    block = MoeBlock(spec, hidden, tp=..., dtype=..., device=...)
    out = block(h)                    # h [T, hidden] -> [T, hidden]
    block(h, routes=sink)             # also sink.write(block.route_index, ids [T, top_k]): the experts
                                      # chosen (cache/routes.py); the model numbers its MoE blocks
    block(h, valid=n)                 # a captured batch of which only the first n rows (a device int
                                      # scalar) are real tokens: the others get no expert work

The router is transformers' (Qwen2/Qwen3-MoE `TopKRouter`): logits in the model dtype, softmax in float32,
top-k (equal scores to the lowest expert id: layers/topk.py), renormalised when `norm_topk_prob`, the
weights rounded to the model dtype. The experts hold one fused layout, `gate_up_proj` [E, 2 * I, H]
(gate rows, then up rows) and `down_proj` [E, H, I], the layout transformers 5 keeps in memory; the
hub's per-expert tensors load into slices of it. On CUDA the experts run in one fused Triton pipeline
(layers/moe_kernels.py: sort by expert, grouped GEMMs with SiLU-and-mul, weighted combine; no host
syncs, so decode steps are captured in CUDA graphs); elsewhere `experts_reference`, a torch loop over
the experts hit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rollout.distributed import SINGLE, TPGroup
from rollout.layers.fused import use_fused
from rollout.layers.linear import ReplicatedLinear, Shard, empty_param
from rollout.layers.mlp import GatedMLP
from rollout.layers.topk import topk_lowest_index_first

GATE_UP, DOWN = "gate_up_proj", "down_proj"  # the fused parameters (and their HF names)
PER_EXPERT = {"gate_proj": (GATE_UP, 0), "up_proj": (GATE_UP, 1), "down_proj": (DOWN, None)}


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool
    shared_intermediate_size: int = 0  # 0: no shared expert

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be between 1 and num_experts={self.num_experts}"
            )


# -- router ----------------------------------------------------------------------------------------
class Router(ReplicatedLinear):
    """The [experts, hidden] gate and transformers' top-k over its float32 softmax."""

    def __init__(self, spec: MoeSpec, hidden: int, *, dtype: torch.dtype, device=None):
        super().__init__(hidden, spec.num_experts, dtype=dtype, device=device)
        self.top_k, self.renormalise = spec.top_k, spec.norm_topk_prob

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] -> (weights [T, K] in h's dtype, expert ids [T, K] int32), highest weight first."""
        return top_k_route(self(h), self.top_k, self.renormalise)


def top_k_route(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' routing from router logits [T, E] (model dtype): float32 softmax, top-k, optional
    renormalisation, weights rounded to the logits' dtype. Equal probabilities (bfloat16 logits tie
    often) go to the lowest expert id, as a stable sort would pick: torch.topk leaves ties to its
    kernel, so a token's experts would depend on the batch around it and the device. The torch and the
    fused experts both take their ids from here."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = topk_lowest_index_first(probs, k, nonnegative=True)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids.to(torch.int32)


# -- experts ---------------------------------------------------------------------------------------
class Experts(nn.Module):
    """Every expert's gate/up and down matrices, each split along the expert's intermediate dim over TP.

    Loadable names (shard): the fused `gate_up_proj` / `down_proj` (None), and the hub's per-expert
    `N.gate_proj.weight` / `N.up_proj.weight` / `N.down_proj.weight` ((part, N): part 0 gate, 1 up,
    None down). The output of forward is this rank's partial sum (the block all-reduces once).
    """

    shard_names = (None,)

    def __init__(self, spec: MoeSpec, hidden: int, *, tp: TPGroup = SINGLE, dtype: torch.dtype, device=None):
        super().__init__()
        self.tp, self.num_experts, self.hidden = tp, spec.num_experts, hidden
        self.inter = spec.intermediate_size
        self.local = tp.shard(spec.intermediate_size, "moe_intermediate_size")
        E, H, Il = spec.num_experts, hidden, self.local
        self.gate_up_proj = empty_param(E, 2 * Il, H, dtype=dtype, device=device)
        self.down_proj = empty_param(E, H, Il, dtype=dtype, device=device)

    def forward(
        self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """h [T, H], weights/ids [T, K] -> [T, H] (this rank's partial sum). `valid`: a device int
        scalar; rows at or past it are padding and get no expert work (their output is zero)."""
        if use_fused(h):
            from rollout.layers import moe_kernels  # triton: imported on first use

            return moe_kernels.fused_experts(h, self.gate_up_proj, self.down_proj, weights, ids, valid)
        if valid is not None:
            ids = ids.masked_fill(torch.arange(len(ids), device=ids.device)[:, None] >= valid, -1)
        return experts_reference(h, self.gate_up_proj, self.down_proj, weights, ids)

    # -- loading by HF name ------------------------------------------------------------------------
    def hf_shape(self, param: str, shard: Shard | tuple) -> tuple[int, ...]:
        E, H, I = self.num_experts, self.hidden, self.inter  # noqa: E741
        if shard is None:
            return (E, 2 * I, H) if param == GATE_UP else (E, H, I)
        return (I, H) if param == GATE_UP else (H, I)

    def copy_pair(
        self, param: str, shard: Shard | tuple, full: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(destination view, source view), or None when this rank's part is two blocks (load)."""
        Il, r = self.local, self.tp.rank
        if shard is None:
            if param == DOWN:
                return self.down_proj.data, full.narrow(2, r * Il, Il)
            return (self.gate_up_proj.data, full) if self.tp.size == 1 else None
        part, e = shard
        if param == DOWN:
            return self.down_proj.data[e], full.narrow(1, r * Il, Il)
        return self.gate_up_proj.data[e].narrow(0, part * Il, Il), full.narrow(0, r * Il, Il)

    def load(self, param: str, shard: Shard | tuple, full: torch.Tensor) -> None:
        pair = self.copy_pair(param, shard, full)
        if pair is not None:
            pair[0].copy_(pair[1])
            return
        Il, I, r = self.local, self.inter, self.tp.rank  # noqa: E741  (fused gate_up under TP)
        self.gate_up_proj.data[:, :Il].copy_(full[:, r * Il : (r + 1) * Il])
        self.gate_up_proj.data[:, Il:].copy_(full[:, I + r * Il : I + (r + 1) * Il])

    def read(self, param: str, shard: Shard | tuple) -> torch.Tensor:
        Il, gather = self.local, self.tp.all_gather
        if shard is None:
            if param == DOWN:
                return gather(self.down_proj.data, dim=2)
            w = self.gate_up_proj.data
            if self.tp.size == 1:
                return w
            return torch.cat([gather(w[:, :Il], dim=1), gather(w[:, Il:], dim=1)], dim=1)
        part, e = shard
        if param == DOWN:
            return gather(self.down_proj.data[e], dim=1)
        return gather(self.gate_up_proj.data[e].narrow(0, part * Il, Il), dim=0)


def experts_reference(
    h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The experts in torch, grouped by expert (one pair of matmuls per expert hit): the CPU path and
    the kernels' oracle. ids [T, K] int (-1: no expert); the sum over a token's experts in float32,
    rounded once to h's dtype."""
    T, K = ids.shape
    out = torch.zeros(T, h.shape[1], dtype=torch.float32, device=h.device)
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat[flat >= 0], minlength=gate_up.shape[0]).tolist()
    start = int((flat < 0).sum())  # unrouted entries sort first
    for e, n in enumerate(counts):
        if not n:
            continue
        entries = order[start : start + n]
        start += n
        tokens = entries // K
        gate, up = F.linear(h[tokens], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out.index_add_(0, tokens, y.float() * weights.reshape(-1)[entries, None].float())
    return out.to(h.dtype)


# -- the block -------------------------------------------------------------------------------------
class MoeBlock(nn.Module):
    """Router + experts (+ a shared expert with a sigmoid gate, Qwen2-MoE's) for one decoder layer."""

    def __init__(self, spec: MoeSpec, hidden: int, *, tp: TPGroup = SINGLE, dtype: torch.dtype, device=None):
        super().__init__()
        self.spec, self.tp = spec, tp
        self.route_index = 0  # this block's index among the model's MoE blocks (its routes' column)
        self.gate = Router(spec, hidden, dtype=dtype, device=device)
        self.experts = Experts(spec, hidden, tp=tp, dtype=dtype, device=device)
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_intermediate_size:
            self.shared_expert = GatedMLP(
                hidden,
                spec.shared_intermediate_size,
                size_name="shared_expert_intermediate_size",
                tp=tp,
                dtype=dtype,
                device=device,
            )
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor, routes: Any = None, valid: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = self.gate.route(h)
        if routes is not None:
            routes.write(self.route_index, ids)
        out = self.tp.all_reduce(self.experts(h, weights, ids, valid))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return out
