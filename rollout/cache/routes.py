"""Routed experts by KV slot: which experts each MoE layer chose for each cached token (R3).

The store sits beside the KV cache and is indexed like it: row `slot` holds the top-k expert ids of the
token whose k/v live in that slot, for every MoE layer ([num_slots, num_moe_layers, top_k]). A token's
routes are written by the forward that computes its k/v, so whatever keeps a token's KV keeps its
routes: prefix-cache hits read the routes of the request that filled the pages, and a preempted
sequence's recomputation rewrites them. Padding rows of a captured batch write to the scratch page.

The ids are int16 when the model has at most 32767 experts (every released MoE: 8 to 384), int32
beyond: half the bytes of int32, and the store is ~1% of the KV bytes (Qwen3-30B-A3B: 48 x 8 x 2 = 768
bytes a token against 96 KiB of bf16 KV). Reads widen them to int32, the type the fronts send.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class RouteSink:
    """Where one step's routes go: `store` rows `slots` (one per token of the step)."""

    store: torch.Tensor  # [num_slots, num_moe_layers, top_k]
    slots: torch.Tensor  # int64 [T]

    def write(self, layer: int, ids: torch.Tensor) -> None:
        """ids [T, top_k]: the experts MoE layer `layer` (its index among the MoE layers) chose."""
        self.store[self.slots, layer] = ids.to(self.store.dtype)


class RouteStore:
    def __init__(self, num_slots: int, num_layers: int, top_k: int, num_experts: int, device: torch.device):
        dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self.table = torch.full((num_slots, num_layers, top_k), -1, dtype=dtype, device=device)
        self._stream: torch.cuda.Stream | None = None  # for reads (read_many), made on first use

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def sink(self, slots: torch.Tensor) -> RouteSink:
        return RouteSink(self.table, slots)

    def read(self, slots: np.ndarray) -> torch.Tensor:
        """The routes of tokens in `slots` (host array), as a CPU int32 tensor [len(slots), L, K]."""
        return self.read_many([slots])[0]

    def read_many(self, slot_lists: list[np.ndarray]) -> list[torch.Tensor]:
        """The routes of several token lists in one gather and one copy to the host.

        On a GPU the read runs on a stream of its own. The rows it reads were written by steps already
        collected, while the default stream may be running the next step (overlap): reading there would
        wait for that step, once per finishing sequence."""
        sizes = [len(s) for s in slot_lists]
        index = torch.from_numpy(np.concatenate([np.asarray(s, dtype=np.int64) for s in slot_lists]))
        if self.table.device.type != "cuda":
            return list(self.table[index].to(torch.int32).split(sizes))
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.table.device)
        with torch.cuda.stream(self._stream):
            rows = self.table[index.to(self.table.device)].to("cpu", torch.int32)  # waits for this stream
        return list(rows.split(sizes))


def encode_routes(routes: Any) -> str:
    """Routes as SGLang's fronts send them (meta_info["routed_experts"], what slime and miles decode):
    base64 of the int32 array's bytes, C order, little-endian."""
    array = np.ascontiguousarray(np.asarray(routes), dtype="<i4")
    return base64.b64encode(array.tobytes()).decode("ascii")
