"""Turns a scheduled batch into tensors, runs the model and samples: the device side of a step.

Host work per step is numpy over the batch (no per-request tensor work): the page table comes from a
mirror updated incrementally (page_table.py), and the batch's integers reach the device in one pinned,
non-blocking copy (transfer.py). Decode steps that fit a captured CUDA graph write straight into its
static buffers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from rollout.attention.base import AttentionBackend, AttnBatch, ForwardContext
from rollout.runner.batch import HostBatch, StepInputs, StepOutput
from rollout.runner.graphs import CaptureContext, GraphRunner
from rollout.runner.logit_adjust import LogitAdjust
from rollout.runner.page_table import HostPageTable
from rollout.runner.sampler import SampleResult, SamplingBatch, sample
from rollout.scoring import prompt_logprobs
from rollout.sequence import uniforms
from rollout.transfer import to_device

if TYPE_CHECKING:
    from rollout.lora import LoraManager
    from rollout.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        vocab_size: int,
        device: torch.device,
        *,
        max_model_len: int = 4096,
        max_running: int = 256,
        lora: LoraManager | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ):
        self.lora = lora  # adapter slots (None: LoRA off)
        self.model, self.backend, self.vocab_size, self.device = model, backend, vocab_size, device
        self.eos_ids = eos_ids  # what min_tokens masks
        self.page_size = backend.kv.page_size
        self.max_model_len = max_model_len
        self.page_table = HostPageTable(2 * max_running + 8, -(-max_model_len // self.page_size))
        self.graphs: GraphRunner | None = None  # decode graphs, once captured
        self.graph_steps = self.eager_steps = 0

    def capture_graphs(
        self, max_bs: int, hidden_size: int, dtype: torch.dtype, capture: CaptureContext
    ) -> None:
        """Capture decode graphs for batch sizes up to `max_bs`; from then on `step` replays one whenever
        a decode batch fits."""
        self.graphs = GraphRunner(
            self.model,
            self.backend,
            max_bs=max_bs,
            max_pages=-(-self.max_model_len // self.page_size),
            hidden_size=hidden_size,
            dtype=dtype,
            device=self.device,
            capture_context=capture,
            lora=self.lora.state if self.lora is not None else None,
        )
        self.graphs.capture()

    # -- host side --------------------------------------------------------------------------------
    def host_batch(self, batch: ScheduledBatch) -> HostBatch:
        seqs, S = batch.seqs, self.page_size
        B = len(seqs)
        rows = self.page_table.rows(seqs)
        starts = np.fromiter((s.num_computed for s in seqs), dtype=np.int64, count=B)
        if batch.decode:
            ids = np.fromiter((s.token_ids[-1] for s in seqs), dtype=np.int64, count=B)
            positions, seq_lens = starts, starts + 1
            sampled = np.arange(B)
        else:
            chunks = np.asarray(batch.chunks, dtype=np.int64)
            seq_lens = starts + chunks
            ids = np.concatenate([s.token_ids[a : a + c] for s, a, c in zip(seqs, starts, chunks)])
            positions = np.arange(len(ids)) - np.repeat(np.cumsum(chunks) - chunks - starts, chunks)
            totals = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=B)
            sampled = np.flatnonzero(seq_lens == totals)
        table = self.page_table.gather(rows, int(-(-seq_lens.max() // S)))
        owner = np.repeat(np.arange(B), batch.chunks) if not batch.decode else np.arange(B)
        slots = table[owner, positions // S].astype(np.int64) * S + positions % S
        lora = self._token_slots(seqs, owner)
        return HostBatch(batch.decode, ids, positions, slots, seq_lens, batch.chunks, table, sampled, lora)

    def _token_slots(self, seqs: list, owner: np.ndarray) -> np.ndarray | None:
        """Each token's LoRA slot (from its sequence's lora_name); None when no token uses an adapter."""
        if self.lora is None or all(s.params.lora_name is None for s in seqs):
            return None
        slot = self.lora.slot
        per_seq = np.fromiter((slot(s.params.lora_name) for s in seqs), dtype=np.int64, count=len(seqs))
        return per_seq[owner]

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        host = self.host_batch(batch)
        seqs = batch.seqs if host.decode else [batch.seqs[i] for i in host.sampled.tolist()]
        sampling = (
            SamplingBatch.build([s.params for s in seqs], uniforms(seqs), self.vocab_size, self.device)
            if seqs
            else None
        )
        if sampling is not None and sampling.adjusts_logits:
            sampling.adjust = LogitAdjust.build(seqs, self.eos_ids, self.vocab_size, self.device)
        if host.decode and self.graphs is not None and self.graphs.fits(host.batch_size):
            return self.graphs.load(host, sampling)
        return self.eager_inputs(host, sampling)

    def eager_inputs(self, host: HostBatch, sampling: SamplingBatch | None) -> StepInputs:
        B = host.batch_size
        cu = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(host.q_lens, out=cu[1:])
        arrays = [
            host.ids,
            host.positions,
            host.slots,
            cu[1:][host.sampled].astype(np.int64) - 1,
            host.page_table,
            host.seq_lens.astype(np.int32),
            cu,
        ]
        if host.token_slots is not None:
            arrays.append(host.token_slots)
        ids, positions, slots, rows, page_table, seq_lens, cu_seqlens, *lora = to_device(arrays, self.device)
        attn = AttnBatch(
            decode=host.decode,
            q_lens=host.q_lens,
            seq_lens_cpu=host.seq_lens.tolist(),
            page_table=page_table,
            seq_lens=seq_lens,
            cu_seqlens_q=cu_seqlens,
            slot_mapping=slots,
            max_q_len=max(host.q_lens),
            max_seq_len=int(host.seq_lens.max()),
            page_table_cpu=host.page_table,
        )
        # decode samples every row: a slice avoids a gather
        logit_rows = slice(0, B) if host.decode else rows
        return StepInputs(ids, positions, attn, logit_rows, sampling, lora_slots=lora[0] if lora else None)

    # -- device side ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_hidden(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states [T, hidden] of every token of the step."""
        if inputs.graph_bs is not None:
            self.graph_steps += 1
            return self.graphs.replay(inputs)
        self.eager_steps += 1
        if self.lora is not None:
            self.lora.state.begin(inputs.lora_slots)
        ctx = ForwardContext(self.backend, self.backend.begin(inputs.attn))
        return self.model(inputs.input_ids, inputs.positions, ctx)

    @torch.inference_mode()
    def forward_logits(self, inputs: StepInputs) -> torch.Tensor:
        """float32 logits [N, vocab] for the rows that sample."""
        return self.model.logits(self.forward_hidden(inputs)[inputs.logit_rows])

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> StepOutput | None:
        inputs = self.prepare(batch)
        hidden = self.forward_hidden(inputs)
        # logprobs of given tokens at the chunk's positions (rollout/scoring.py), before sampling
        prompt = prompt_logprobs(self.model, hidden, batch, self.vocab_size)
        if inputs.sampling is None:
            return None if prompt is None else StepOutput([], [], None, prompt)
        logits = self.model.logits(hidden[inputs.logit_rows])
        out = to_host(sample(logits, inputs.sampling), inputs.sampling.num_top_logprobs)
        out.prompt = prompt
        return out


def to_host(res: SampleResult, k: int) -> StepOutput:
    """One device-to-host copy for everything the step produced."""
    cols = [res.tokens.double().unsqueeze(1), res.logprobs.double().unsqueeze(1)]
    if k:
        cols += [res.top_ids.double(), res.top_logprobs.double()]
    rows = torch.cat(cols, dim=1).cpu().tolist()
    tokens = [int(r[0]) for r in rows]
    logprobs = [r[1] for r in rows]
    top = [dict(zip(map(int, r[2 : 2 + k]), r[2 + k :])) for r in rows] if k else None
    return StepOutput(tokens, logprobs, top)
