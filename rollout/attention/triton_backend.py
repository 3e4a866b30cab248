"""Attention with this package's Triton kernels (triton_kernels.py): split-KV paged decode and a causal
paged extend kernel for prefill. Both read the page table directly and take seq_len 0 padding rows, so
decode runs inside CUDA graphs with no per-step planning."""

from __future__ import annotations

import torch

from rollout.attention.base import AttentionBackend, AttnBatch
from rollout.attention.triton_kernels import paged_decode_attention, paged_extend_attention
from rollout.cache.pool import KVPool

MAX_KV_SPLITS = 8


class TritonBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, kv: KVPool, num_heads: int, head_dim: int, sm_scale: float):
        super().__init__(kv, num_heads, head_dim, sm_scale)
        dev = torch.device(kv.device)
        on_gpu = dev.type == "cuda"
        self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if on_gpu else 1

    def num_kv_splits(self, batch_size: int) -> int:
        """Split each request's KV so that about four blocks per SM are busy; a large batch needs none.
        Depends only on the batch size, so a captured graph keeps its grid."""
        blocks = batch_size * self.kv.num_kv_heads
        return max(1, min(MAX_KV_SPLITS, -(-4 * self.num_sms // blocks)))

    def begin(self, batch: AttnBatch) -> AttnBatch:
        return batch

    def begin_graph(self, batch: AttnBatch) -> AttnBatch:
        return batch  # the kernels read page_table / seq_lens from the graph's static buffers

    def forward(self, q, k, v, layer, meta: AttnBatch):
        # q: [T, Hq, D], k/v: [T, Hkv, D]
        self.kv.store(layer, meta.slot_mapping, k, v)
        k_cache, v_cache = self.kv.layer(layer)
        if meta.decode:
            return paged_decode_attention(
                q,
                k_cache,
                v_cache,
                meta.page_table,
                meta.seq_lens,
                self.sm_scale,
                num_kv_splits=self.num_kv_splits(meta.batch_size),
            )
        return paged_extend_attention(
            q,
            k_cache,
            v_cache,
            meta.page_table,
            meta.cu_seqlens_q,
            meta.seq_lens,
            self.sm_scale,
            max_q_len=meta.max_q_len,
        )
