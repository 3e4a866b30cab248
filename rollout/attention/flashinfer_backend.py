"""Attention with flashinfer's paged kernels: a decode wrapper and a prefill (append) wrapper, planned
once per step from the host page table and run by every layer.

flashinfer reads pages through CSR arrays (indptr, indices, last_page_len) rather than a padded page
table; they are built with numpy from AttnBatch.page_table_cpu. Decode steps captured in CUDA graphs
use one wrapper per batch size whose arrays live in fixed buffers; `begin_graph` re-plans it into them
before each replay (flashinfer's plan is host work plus copies into those buffers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flashinfer
import numpy as np
import torch

from rollout.attention.base import AttentionBackend, AttnBatch
from rollout.attention.flashinfer_workspace import workspace_bytes
from rollout.cache.pool import KVPool
from rollout.device.staging import Staging, to_device

INT_WORKSPACE_BYTES = 8 << 20  # plan arrays of the graph wrappers (shared, re-planned before each replay)


@dataclass
class _Meta:
    wrapper: Any
    slot_mapping: torch.Tensor


class FlashInferBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, kv: KVPool, num_heads: int, head_dim: int, sm_scale: float):
        super().__init__(kv, num_heads, head_dim, sm_scale)
        if kv.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention_backend='flashinfer' needs float16 or bfloat16, got {kv.dtype}")
        self.device = torch.device(kv.device)
        self.num_sm = torch.cuda.get_device_properties(self.device).multi_processor_count
        # flashinfer's CUDA-core decode kernel handles query-group sizes 1-4 and 8 only, and the
        # tensor-core (prefill) kernel is faster for large groups anyway
        self.tensor_cores = num_heads // kv.num_kv_heads > 4
        # split-KV partial results, shared by every wrapper (one runs at a time)
        self._make_eager_wrappers(self._workspace_for(graph_batch=0))
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_buffers: dict[int, tuple[torch.Tensor, ...]] = {}  # bs -> indptr, indices, last_page_len
        self._graph_int_workspace: torch.Tensor | None = None
        self._graph_indptr: dict[int, np.ndarray] = {}  # bs -> the indptr its buffers were last filled with
        self._plan_events: dict[int, Any] = {}  # id(wrapper) -> event recorded after its last plan
        self._staging = Staging(self.device)  # pinned buffers of the graph CSR uploads

    # -- planning ---------------------------------------------------------------------------------
    def begin(self, batch: AttnBatch) -> _Meta:
        indptr, indices, last = self._csr(batch)
        if batch.decode:
            self._plan_decode(self.decode_wrapper, indptr, indices, last)
            return _Meta(self.decode_wrapper, batch.slot_mapping)
        qo_indptr = np.zeros(batch.batch_size + 1, dtype=np.int32)
        np.cumsum(batch.q_lens, out=qo_indptr[1:])
        self._wait_for_last_plan(self.prefill_wrapper)
        self.prefill_wrapper.plan(
            torch.from_numpy(qo_indptr),
            indptr,
            indices,
            last,
            self.num_heads,
            self.kv.num_kv_heads,
            self.head_dim,
            self.kv.page_size,
            causal=True,  # bottom-right aligned: new token j of a request sees its prefix and j's past
            sm_scale=self.sm_scale,
            q_data_type=self.kv.dtype,
            kv_data_type=self.kv.dtype,
        )
        self._mark_plan(self.prefill_wrapper)
        return _Meta(self.prefill_wrapper, batch.slot_mapping)

    def _workspace_for(self, graph_batch: int) -> int:
        return workspace_bytes(self.num_heads, self.kv.num_kv_heads, self.head_dim, self.num_sm, graph_batch)

    def _make_eager_wrappers(self, workspace: int) -> None:
        self.workspace = torch.zeros(workspace, dtype=torch.uint8, device=self.device)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores
        )
        # fa2 rather than "auto" (fa3 on Hopper): the tensor-core decode path JIT-compiles the same fa2
        # module, so one build serves both; attention is a few percent of a prefill step's FLOPs here
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2"
        )

    def _reserve_for_graph(self, bs: int) -> None:
        """Grow the workspace to what a graph of `bs` requests plans. Only before the first capture: a
        captured graph keeps the address of the workspace it was planned into (the largest batch is
        captured first, so it is the one that grows it)."""
        need = self._workspace_for(graph_batch=bs)
        if need <= self.workspace.numel():
            return
        if self._graph_wrappers:
            raise RuntimeError(
                f"flashinfer: a CUDA graph of batch {bs} needs a {need >> 20} MiB workspace after graphs "
                f"were captured in {self.workspace.numel() >> 20} MiB; capture the largest batch first"
            )
        self._make_eager_wrappers(need)

    def begin_graph(self, batch: AttnBatch) -> _Meta:
        bs = batch.batch_size
        if bs not in self._graph_wrappers:  # first call, before capture: a full plan
            self._reserve_for_graph(bs)
            wrapper = self._graph_wrappers[bs] = self._make_graph_wrapper(bs, batch.page_table.shape[1])
            self._plan_decode(wrapper, *self._csr(batch))
            return _Meta(wrapper, batch.slot_mapping)
        # before a replay: fill the graph's CSR buffers in one upload, then flashinfer's lean re-plan,
        # which skips the buffer copies and host loops of plan() (the plan's shape depends only on bs)
        wrapper = self._graph_wrappers[bs]
        indptr_buf, indices_buf, last_buf = self._graph_buffers[bs]
        kept = self._graph_indptr.get(bs)
        if batch.same_pages and kept is not None:
            # the pages are the last step's (no request entered a new page): indptr and indices, on the
            # host and in the graph's buffers, still hold; only the last page's fill moved
            indptr = kept
            lens = np.maximum(np.asarray(batch.seq_lens_cpu, dtype=np.int32), 1)
            last = (lens - (np.diff(indptr) - 1) * self.kv.page_size).astype(np.int32)
            last_buf.copy_(to_device([last], self.device, self._staging)[0], non_blocking=True)
        else:
            indptr, indices, last = paged_csr(batch.seq_lens_cpu, batch.page_table_cpu, self.kv.page_size)
            if len(indices) > len(indices_buf):
                raise ValueError(f"{len(indices)} pages exceed the CUDA-graph buffer of {len(indices_buf)}")
            dev_indptr, dev_indices, dev_last = to_device([indptr, indices, last], self.device, self._staging)
            indptr_buf.copy_(dev_indptr, non_blocking=True)
            indices_buf[: len(indices)].copy_(dev_indices, non_blocking=True)
            last_buf.copy_(dev_last, non_blocking=True)
            self._graph_indptr[bs] = indptr
        self._wait_for_last_plan(wrapper)
        flashinfer.fast_decode_plan(
            wrapper,
            torch.from_numpy(indptr),
            indices_buf,
            torch.from_numpy(last),
            self.num_heads,
            self.kv.num_kv_heads,
            self.head_dim,
            self.kv.page_size,
            q_data_type=self.kv.dtype,
            kv_data_type=self.kv.dtype,
            sm_scale=self.sm_scale,
            global_override_indptr_cpu=torch.from_numpy(indptr),
        )
        self._mark_plan(wrapper)
        return _Meta(wrapper, batch.slot_mapping)

    def _make_graph_wrapper(self, bs: int, max_pages: int) -> Any:
        dev = self.device
        buffers = (
            torch.zeros(bs + 1, dtype=torch.int32, device=dev),
            torch.zeros(bs * max_pages, dtype=torch.int32, device=dev),
            torch.zeros(bs, dtype=torch.int32, device=dev),
        )
        self._graph_buffers[bs] = buffers
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=buffers[0],
            paged_kv_indices_buffer=buffers[1],
            paged_kv_last_page_len_buffer=buffers[2],
        )
        if self._graph_int_workspace is None:
            self._graph_int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        wrapper.reset_workspace_buffer(self.workspace, self._graph_int_workspace)
        return wrapper

    def _plan_decode(self, wrapper: Any, indptr, indices, last) -> None:
        self._wait_for_last_plan(wrapper)
        wrapper.plan(
            indptr,
            indices,
            last,
            self.num_heads,
            self.kv.num_kv_heads,
            self.head_dim,
            self.kv.page_size,
            sm_scale=self.sm_scale,
            q_data_type=self.kv.dtype,
            kv_data_type=self.kv.dtype,
        )
        self._mark_plan(wrapper)

    # plan() writes its arrays into the wrapper's pinned host buffer and queues a copy to the device. A
    # step that samples nothing (a partial prefill) does not wait for the device, so the next plan could
    # overwrite that buffer before the queued copy ran: an event recorded after each plan guards it.
    def _wait_for_last_plan(self, wrapper: Any) -> None:
        event = self._plan_events.get(id(wrapper))
        if event is not None:
            event.synchronize()

    def _mark_plan(self, wrapper: Any) -> None:
        if self.device.type == "cuda":
            event = self._plan_events[id(wrapper)] = torch.cuda.Event()
            event.record()

    def _csr(self, batch: AttnBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """indptr (host), indices (device), last_page_len (host), all int32, from the host page table."""
        if batch.page_table_cpu is None:
            raise ValueError("the flashinfer backend needs AttnBatch.page_table_cpu (the host page table)")
        indptr, indices, last = paged_csr(batch.seq_lens_cpu, batch.page_table_cpu, self.kv.page_size)
        indices_t = torch.from_numpy(indices)
        if self.device.type == "cuda":
            indices_t = indices_t.pin_memory().to(self.device, non_blocking=True)
        return torch.from_numpy(indptr), indices_t, torch.from_numpy(last)

    # -- per layer --------------------------------------------------------------------------------
    def forward(self, q, k, v, layer, meta: _Meta):
        # q: [T, Hq, D], k/v: [T, Hkv, D]
        self.kv.store(layer, meta.slot_mapping, k, v)
        return meta.wrapper.run(q.contiguous(), self.kv.layer(layer))


def paged_csr(
    seq_lens: list[int] | np.ndarray, table: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """flashinfer's paged-KV arrays from a padded page table: indptr [B + 1], indices [sum of pages]
    and last_page_len [B] (int32). A row with seq_len 0 (CUDA-graph padding) gets one token of the
    page in its column 0 (the scratch page), since flashinfer wants 1 <= last_page_len."""
    lens = np.maximum(np.asarray(seq_lens, dtype=np.int32), 1)
    num_pages = (lens + page_size - 1) // page_size
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    indices = table[np.arange(table.shape[1]) < num_pages[:, None]]  # row-major: request order
    last = (lens - (num_pages - 1) * page_size).astype(np.int32)
    return indptr, np.ascontiguousarray(indices, dtype=np.int32), last
