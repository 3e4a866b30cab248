"""The attention backend interface: one step's inputs, shared by every backend, and the ABC."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollout.cache.pool import KVPool


@dataclass
class AttnBatch:
    """Where one step's new tokens go in the paged cache and what each of them attends to.

    Request b has q_lens[b] new tokens at positions seq_lens[b] - q_lens[b] .. seq_lens[b] - 1; their
    k/v are written to slot_mapping before attention, then each attends causally to its request's pages.
    """

    decode: bool  # every request has exactly one new token
    q_lens: list[int]
    seq_lens_cpu: list[int]
    page_table: torch.Tensor  # int32 [B, max_pages]
    seq_lens: torch.Tensor  # int32 [B]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    slot_mapping: torch.Tensor  # int64 [T]: page * page_size + offset of each new token
    max_q_len: int
    max_seq_len: int
    page_table_cpu: np.ndarray | None = None  # int32 [B, >= pages used]: host copy (flashinfer plans from it)
    # the same sequences' pages as in the previous decode step of this batch size (only seq_lens moved):
    # planning may reuse what it derived from the page table then
    same_pages: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)


class AttentionBackend(ABC):
    """Computes attention over the paged KV cache. `begin` runs once a step, `forward` once a layer."""

    # whether decode steps may be captured in CUDA graphs (see begin_graph)
    supports_cuda_graph: bool = False

    def __init__(self, kv: KVPool, num_heads: int, head_dim: int, sm_scale: float):
        self.kv, self.num_heads, self.head_dim, self.sm_scale = kv, num_heads, head_dim, sm_scale

    def begin(self, batch: AttnBatch) -> Any:
        """Per-step metadata handed back to `forward` (default: the batch itself)."""
        return batch

    def begin_graph(self, batch: AttnBatch) -> Any:
        """`begin` for a decode batch of a captured CUDA-graph size: its device tensors are the graph's
        static buffers and page_table_cpu / seq_lens_cpu are set. Called before capture (the metadata
        returned is captured) and again before each replay with the new step's values, so whatever it
        does on the device must write into buffers of fixed address. Padding rows have seq_len 0 and
        the pool's scratch page in column 0; their output is discarded."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: Any
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens; returns [T, Hq, D]."""


@dataclass
class ForwardContext:
    """What every layer needs for one step besides its input: the attention backend and its metadata,
    and for MoE layers the routes' destination and the count of real rows, and for a model with
    per-request state (rollout/cache/state.py) the step's StateBatch."""

    backend: AttentionBackend
    meta: Any
    state: Any = None
    routes: Any = None  # a cache.routes.RouteSink when the engine records routed experts
    # a device int scalar: rows at or past it are padding of a captured batch (MoE layers skip them)
    valid_rows: torch.Tensor | None = None
