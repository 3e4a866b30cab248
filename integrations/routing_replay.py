"""Routing replay (R3, arXiv 2510.11370) for a transformers MoE policy: the trainer's forward uses the
experts the engine chose.

Two forwards of one MoE model disagree on about a tenth of their router decisions (batch shapes,
kernels, precision), and each disagreement swaps a whole expert's contribution, so the trainer's
logprobs drift from the engine's and RL collapses. With replay the top-k *set* of every token and layer
is the engine's (`CompletionOutput.routed_experts`); the gate weights are recomputed from the trainer's
own router logits (softmax in float32, gathered at the engine's experts, renormalised where the model
asks), so the router still gets gradients.

    replay = RoutingReplay(policy)    # Qwen3-MoE, Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE (transformers 5)
    routes = pad_routes([o.routed_experts for o in completions], seq_len)   # [B, S, L, K], -1 = pad
    with replay.use(routes):                         # one micro-batch (right-padded like input_ids)
        logits = policy(input_ids, attention_mask=mask).logits

Rows of `routes` that are -1 (padding, and a sequence's last token, which the engine never ran
forward) keep the trainer's own top-k. `RouteRecorder` captures the trainer's own choices, and
`route_mismatch` tells the fraction of tokens whose routes differ from the engine's in any layer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

# transformers' routers that renormalise their top-k with no `norm_topk_prob` switch
ALWAYS_RENORMALISED = ("Qwen3_5MoeTopKRouter",)


def renormalises(gate: nn.Module) -> bool:
    return type(gate).__name__ in ALWAYS_RENORMALISED or bool(gate.norm_topk_prob)


def moe_gates(model: nn.Module) -> list[nn.Module]:
    """The router of each sparse block in layer order (a block with `gate` and `experts`): the column
    order of the engine's routes."""
    gates = [
        m.gate
        for m in model.modules()
        if hasattr(m, "experts") and isinstance(getattr(m, "gate", None), nn.Module)
    ]
    if not gates:
        raise ValueError(f"{type(model).__name__} has no MoE blocks (a module with `gate` and `experts`)")
    for g in gates:
        known = hasattr(g, "norm_topk_prob") or type(g).__name__ in ALWAYS_RENORMALISED
        if not (known and hasattr(g, "top_k") and hasattr(g, "weight")):
            raise TypeError(f"{type(g).__name__} is not a top-k softmax router this replay knows")
    return gates


def replayed_weights(
    logits: torch.Tensor, ids: torch.Tensor, renormalise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate weights in logits' dtype, ids int64) for given expert ids [N, K] (-1: the router's own
    top-k): float32 softmax of the logits gathered at the ids, renormalised when asked, as the router
    computes them for its own choice."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    own = torch.topk(probs, ids.shape[-1], dim=-1).indices
    ids = torch.where(ids >= 0, ids.long(), own)
    weights = probs.gather(-1, ids)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


class RoutingReplay:
    """Forward hooks on the policy's routers; inactive outside `use`."""

    def __init__(self, model: nn.Module):
        self.gates = moe_gates(model)
        self.top_k = self.gates[0].top_k
        self._routes: torch.Tensor | None = None
        self._handles = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(self.gates)]

    @property
    def num_layers(self) -> int:
        return len(self.gates)

    @contextmanager
    def use(self, routes: torch.Tensor) -> Iterator[None]:
        """Replay `routes` (int [B, S, num_layers, top_k], the micro-batch's tokens in input order)
        in the forwards run inside."""
        if routes.dim() != 4 or routes.shape[2:] != (self.num_layers, self.top_k):
            raise ValueError(
                f"routes must be [batch, seq, {self.num_layers} MoE layers, top_k={self.top_k}], "
                f"got {tuple(routes.shape)}"
            )
        self._routes = routes
        try:
            yield
        finally:
            self._routes = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, layer: int):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._routes is None:
                return output
            logits = output[0]  # [B * S, E]: the trainer's own router logits, with their graph
            ids = self._routes[:, :, layer].reshape(-1, self.top_k).to(logits.device)
            if ids.shape[0] != logits.shape[0]:
                raise ValueError(
                    f"routes cover {ids.shape[0]} tokens, the forward has {logits.shape[0]} "
                    "(routes must be padded like input_ids)"
                )
            weights, ids = replayed_weights(logits, ids, renormalises(module))
            return (logits, weights, ids, *output[3:])

        return hook


class RouteRecorder:
    """Records each router's own top-k in the forwards run inside `record()` (no replay)."""

    def __init__(self, model: nn.Module):
        self.gates = moe_gates(model)
        self.routes: list[torch.Tensor] = []

    @contextmanager
    def record(self) -> Iterator[list[torch.Tensor]]:
        """Yields a list that receives one [B * S, num_layers, top_k] tensor per forward."""
        layers: list[torch.Tensor] = []
        out: list[torch.Tensor] = []

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            layers.append(output[2].detach())
            if len(layers) == len(self.gates):
                out.append(torch.stack(layers, dim=1))
                layers.clear()

        handles = [g.register_forward_hook(hook) for g in self.gates]
        try:
            yield out
        finally:
            for h in handles:
                h.remove()


def pad_routes(routes: Sequence[torch.Tensor], seq_len: int) -> torch.Tensor:
    """Per-sequence routes ([n_i, L, K], n_i <= seq_len: prompt + completion - 1 rows) as one
    right-padded [B, seq_len, L, K] int64 tensor, -1 where a sequence has none."""
    L, K = routes[0].shape[1:]
    out = torch.full((len(routes), seq_len, L, K), -1, dtype=torch.int64)
    for i, r in enumerate(routes):
        if r.shape[0] > seq_len or r.shape[1:] != (L, K):
            raise ValueError(f"routes[{i}] has shape {tuple(r.shape)}; expected [<= {seq_len}, {L}, {K}]")
        out[i, : r.shape[0]] = r
    return out


def route_mismatch(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> float:
    """The fraction of tokens (mask true) whose expert set differs in at least one layer between
    engine and trainer routes ([..., L, K] each, same leading shape)."""
    same = (engine.sort(dim=-1).values == trainer.sort(dim=-1).values).all(dim=-1).all(dim=-1)
    mask = mask.bool()
    return float((~same & mask).sum()) / max(int(mask.sum()), 1)
