"""What every model with sparse feed-forward blocks (layers/moe.py) shares: which layers get one, how a
layer runs it, and the experts' checkpoint names.

Expert weights load from either checkpoint layout: the hub's per-expert tensors
(`mlp.experts.N.gate_proj.weight`, `.up_proj.weight`, `.down_proj.weight`, what save_pretrained writes)
and transformers 5's fused parameters (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I], what a transformers 5 trainer's named_parameters() holds). The per-expert names are the
canonical ones (hf_names, checksums); a fused name `covers` all of its experts' names.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rollout.attention.base import ForwardContext
from rollout.distributed import TPGroup
from rollout.layers.moe import PER_EXPERT, Experts, MoeBlock, MoeSpec
from rollout.models.config import ModelConfig

EXPERT_NAME = re.compile(
    r"^(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
FUSED_NAME = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<param>gate_up_proj|down_proj)$")


def feed_forward(
    cfg: ModelConfig,
    spec: MoeSpec | None,
    layer: int,
    dense: Callable[[], nn.Module],
    *,
    tp: TPGroup,
    dtype: torch.dtype,
    device,
) -> nn.Module:
    """Layer `layer`'s block: sparse when the config lists it in `moe_layers` (its routes' column is its
    index there), else `dense()`."""
    if layer not in cfg.moe_layers:
        return dense()
    block = MoeBlock(spec, cfg.hidden_size, tp=tp, dtype=dtype, device=device)
    block.route_index = cfg.moe_layers.index(layer)
    return block


def run_feed_forward(mlp: nn.Module, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """A sparse block also records its routes and skips the padding rows of a captured batch."""
    if isinstance(mlp, MoeBlock):
        return mlp(h, routes=ctx.routes, valid=ctx.valid_rows)
    return mlp(h)


class ExpertNames:
    """Mixin before a model class whose `_resolve` / `hf_names` handle the dense names."""

    config: ModelConfig
    hf_prefix = "model."  # the checkpoint's name of our `model.` (a text tower: model.language_model.)

    def module_path(self, hf_path: str) -> str:
        if not hf_path.startswith(self.hf_prefix):
            return hf_path  # not ours: get_submodule refuses it
        return "model." + hf_path[len(self.hf_prefix) :]

    def hf_path(self, module_path: str) -> str:
        return self.hf_prefix + module_path.removeprefix("model.")

    def _resolve(self, hf_name: str) -> tuple[nn.Module, str, Any] | None:
        m = EXPERT_NAME.match(hf_name)
        if m is None:
            return super()._resolve(hf_name)  # type: ignore[misc]
        experts, e = self._experts(m["experts"], hf_name), int(m["e"])
        if e >= experts.num_experts:
            raise ValueError(
                f"unknown weight name {hf_name!r} for {self.config.architecture}: expert {e} of "
                f"num_experts={experts.num_experts}"
            )
        param, part = PER_EXPERT[m["proj"]]
        return experts, param, (part, e)

    def _experts(self, hf_path: str, hf_name: str) -> Experts:
        try:
            module = self.get_submodule(self.module_path(hf_path))  # type: ignore[attr-defined]
        except AttributeError:
            module = None
        if not isinstance(module, Experts):
            raise ValueError(f"unknown weight name {hf_name!r} for {self.config.architecture}")
        return module

    def hf_names(self) -> list[str]:
        """The dense names, and each expert's three tensors by the hub's per-expert names."""
        names = super().hf_names()  # type: ignore[misc]
        for path, module in self.named_modules():  # type: ignore[attr-defined]
            if isinstance(module, Experts):
                names += [
                    f"{self.hf_path(path)}.{e}.{proj}.weight"
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
