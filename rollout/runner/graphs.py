"""CUDA-graph decode: the model's decode forward captured once per batch size of a ladder, then replayed.

A decode step of B requests pads to the smallest captured size bs >= B and replays that graph: no
Python runs per layer, so a step costs the GPU time of its kernels. Graphs read their inputs from static
buffers (one set, sized for the largest batch; each graph uses the first bs rows) and write the final
hidden states to a static buffer; logits and sampling run eagerly on the B real rows.

Padding rows decode token 0 at position 0 with seq_len 0, write their k/v to the pool's scratch page
and are dropped. Sizes are captured largest first into one shared memory pool, so smaller graphs reuse
the larger ones' memory. Prefill steps, and decode batches past the largest size, run eagerly.

With LoRA slots (rollout/lora), the graphs include the adapter matmuls and read each row's slot from a
static buffer (padding rows: slot 0, the base model), so one graph serves any mix of adapters, and a
reloaded adapter (copied into its slot in place) is seen by the next replay.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rollout.attention.base import AttentionBackend, AttnBatch, ForwardContext
from rollout.cache.routes import RouteStore
from rollout.cache.state import StateBatch, StatePool
from rollout.lora.layers import LoraState
from rollout.runner.batch import HostBatch, StepInputs
from rollout.runner.sampler import SamplingBatch

log = logging.getLogger("rollout")

# (graph, pool, stream) -> context manager that captures into `graph`; the engine's memory saver
# provides one that tags the graph memory (see rollout/memory/)
CaptureContext = Callable[[torch.cuda.CUDAGraph, Any, Any], contextlib.AbstractContextManager]


def default_capture_context(graph: torch.cuda.CUDAGraph, pool: Any, stream: Any):
    return torch.cuda.graph(graph, pool=pool, stream=stream)


def batch_ladder(max_bs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every 8 to 32, then every 16, and max_bs itself."""
    if max_bs < 1:
        raise ValueError(f"the largest CUDA-graph batch must be >= 1, got {max_bs}")
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, max_bs, 16), max_bs]
    return sorted({b for b in sizes if b <= max_bs})


def padded_size(ladder: list[int], batch_size: int) -> int | None:
    """The smallest captured size that holds `batch_size` rows (None past the largest)."""
    i = bisect.bisect_left(ladder, batch_size)
    return ladder[i] if i < len(ladder) else None


class GraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        *,
        max_bs: int,
        max_pages: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        capture_context: CaptureContext | None = None,
        lora: LoraState | None = None,
        routes: RouteStore | None = None,
        state: StatePool | None = None,
    ):
        if not backend.supports_cuda_graph:
            raise ValueError(f"attention backend {type(backend).__name__} cannot run in CUDA graphs")
        self.model, self.backend, self.device = model, backend, device
        self.ladder = batch_ladder(max_bs)
        self.max_bs, self.max_pages = self.ladder[-1], max_pages
        self.page_size, self.scratch_page = backend.kv.page_size, backend.kv.scratch_page
        self.capture_context = capture_context or default_capture_context
        self._pin = device.type == "cuda"
        # static inputs; graph bs reads longs[0:bs] (ids), [bs:2bs] (positions), [2bs:3bs] (slots)
        self.longs = torch.zeros(3 * self.max_bs, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(self.max_bs, max_pages, dtype=torch.int32, device=device)
        self.cu_seqlens = torch.arange(self.max_bs + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(self.max_bs, hidden_size, dtype=dtype, device=device)
        self.lora, self.routes = lora, routes
        self.lora_slots = torch.zeros(self.max_bs, dtype=torch.int64, device=device) if lora else None
        # per-request state (models that keep one): each row's slot; padding rows use the scratch slot
        self.state = state
        self.state_slots = torch.zeros(self.max_bs, dtype=torch.int64, device=device) if state else None
        self.graphs: dict[int, Any] = {}
        self.pool: Any = None
        self.capture_seconds = 0.0
        self.memory_bytes = 0
        self._loads_since_capture = 0

    # -- capture ----------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every ladder size, largest first (the first graph's pool is shared by the rest)."""
        self.graphs, self.pool = {}, None
        self._loads_since_capture = 0
        free_before = self._free_memory()
        t0 = time.perf_counter()
        for bs in reversed(self.ladder):
            self.graphs[bs] = self._capture_one(bs)
        self.capture_seconds = time.perf_counter() - t0
        self.memory_bytes = free_before - self._free_memory()
        log.info(
            "captured %d decode CUDA graphs (batch sizes %d..%d) in %.1fs using %.0f MiB",
            len(self.graphs),
            self.ladder[0],
            self.max_bs,
            self.capture_seconds,
            self.memory_bytes / 2**20,
        )

    def _capture_one(self, bs: int) -> Any:
        # a dummy step: every row holds one token on the scratch page
        scratch_slot = self.scratch_page * self.page_size
        self.longs[: 2 * bs].zero_()
        self.longs[2 * bs : 3 * bs].fill_(scratch_slot)
        self.seq_lens[:bs].fill_(1)
        self.page_table[:bs, 0].fill_(self.scratch_page)
        attn = self._attn(bs, [1] * bs, np.full((bs, 1), self.scratch_page, dtype=np.int32))
        meta, state = self.backend.begin_graph(attn), self._state_batch(bs)
        ids, positions = self.longs[:bs], self.longs[bs : 2 * bs]
        # padding rows write their routes to the scratch page, like their k/v
        routes = self.routes.sink(attn.slot_mapping) if self.routes is not None else None

        def run() -> None:
            if self.lora is not None:  # the mask is gathered inside the graph, from the static slots
                self.lora.begin(self.lora_slots[:bs])
            # real rows have seq_len >= 1, padding rows 0: MoE layers give the padding no expert work
            valid = (self.seq_lens[:bs] > 0).sum()
            ctx = ForwardContext(self.backend, meta, state, routes=routes, valid_rows=valid)
            self.hidden[:bs].copy_(self.model(ids, positions, ctx))

        with torch.inference_mode():
            run()  # warm-up outside the graph: compiles kernels, settles allocations
            return self._record(run)

    def _state_batch(self, bs: int) -> StateBatch | None:
        if self.state is None:
            return None
        self.state_slots[:bs].fill_(self.state.scratch_slot)
        fresh = torch.zeros(bs, dtype=torch.bool, device=self.device)
        return StateBatch(self.state, self.state_slots[:bs], fresh, [1] * bs, self.cu_seqlens[: bs + 1], True)

    def _record(self, run: Callable[[], None]) -> Any:
        """A CUDA graph of `run` (CPU tests substitute one that re-runs it eagerly on replay)."""
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with self.capture_context(graph, self.pool, None):
            run()
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    def _free_memory(self) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)[0]

    # -- one step ---------------------------------------------------------------------------------
    def fits(self, batch_size: int) -> bool:
        return bool(self.graphs) and batch_size <= self.max_bs

    def padded(self, batch_size: int) -> int | None:
        """The captured size a batch of `batch_size` replays."""
        return padded_size(self.ladder, batch_size)

    def load(self, host: HostBatch, sampling: SamplingBatch | None) -> StepInputs:
        """Copy a decode step's host batch into the static buffers, padded to the next captured size;
        returns the StepInputs that `replay` runs."""
        B = host.batch_size
        bs = padded_size(self.ladder, B)
        mp = host.page_table.shape[1]
        longs = np.zeros(3 * bs, dtype=np.int64)
        longs[:B], longs[bs : bs + B] = host.ids, host.positions
        longs[2 * bs : 2 * bs + B] = host.slots
        longs[2 * bs + B :] = self.scratch_page * self.page_size
        seq_lens = np.zeros(bs, dtype=np.int32)
        seq_lens[:B] = host.seq_lens
        table = np.full((bs, mp), self.scratch_page, dtype=np.int32)
        table[:B] = host.page_table
        self.longs[: 3 * bs].copy_(self._host(longs), non_blocking=True)
        self.seq_lens[:bs].copy_(self._host(seq_lens), non_blocking=True)
        # the last load was these sequences' previous step (the runner saw no replay in between): the
        # buffers already hold their pages and slots. A capture since then writes the buffers.
        kept = self._loads_since_capture > 0
        self._loads_since_capture += 1
        if not (kept and host.same_pages):
            self.page_table[:B, :mp].copy_(self._host(host.page_table), non_blocking=True)
        if self.lora_slots is not None and not (kept and host.same_seqs):
            lora_slots = np.zeros(bs, dtype=np.int64)  # padding rows: the base model
            if host.token_slots is not None:
                lora_slots[:B] = host.token_slots
            self.lora_slots[:bs].copy_(self._host(lora_slots), non_blocking=True)
        if self.state_slots is not None and not (kept and host.same_seqs):
            state_slots = np.full(bs, self.state.scratch_slot, dtype=np.int64)
            state_slots[:B] = host.state_slots
            self.state_slots[:bs].copy_(self._host(state_slots), non_blocking=True)
        attn = self._attn(bs, seq_lens.tolist(), table)
        attn.same_pages = kept and host.same_pages
        return StepInputs(self.longs[:bs], self.longs[bs : 2 * bs], attn, slice(0, B), sampling, graph_bs=bs)

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """Run the captured graph for a step made by `load`; returns hidden states [bs, hidden]."""
        bs = inputs.graph_bs
        self.backend.begin_graph(inputs.attn)  # e.g. flashinfer plans into the graph's buffers
        self.graphs[bs].replay()
        return self.hidden[:bs]

    def _attn(self, bs: int, seq_lens: list[int], table: np.ndarray) -> AttnBatch:
        return AttnBatch(
            decode=True,
            q_lens=[1] * bs,
            seq_lens_cpu=seq_lens,
            page_table=self.page_table[:bs],
            seq_lens=self.seq_lens[:bs],
            cu_seqlens_q=self.cu_seqlens[: bs + 1],
            slot_mapping=self.longs[2 * bs : 3 * bs],
            max_q_len=1,
            max_seq_len=max(seq_lens),
            page_table_cpu=table,
        )

    def _host(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        return t.pin_memory() if self._pin else t
