"""Turns a scheduled batch into tensors, runs the model and samples: the device side of a step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollout.attention.base import AttentionBackend, AttnBatch
from rollout.models.llama import ForwardContext
from rollout.runner.sampler import SampleResult, SamplingBatch, sample
from rollout.scheduler import ScheduledBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn: AttnBatch
    logit_rows: torch.Tensor  # int64 [N]: rows of the hidden states whose next token is sampled
    sampling: SamplingBatch | None


@dataclass
class StepOutput:
    """Host-side results of one step for the sequences that sampled (in batch order)."""

    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float]] | None


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, backend: AttentionBackend, vocab_size: int, device: torch.device
    ):
        self.model, self.backend, self.vocab_size, self.device = model, backend, vocab_size, device
        self.page_size = backend.kv.page_size
        self._pin = device.type == "cuda"

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        if self._pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        S = self.page_size
        starts = np.fromiter((s.num_computed for s in batch.seqs), dtype=np.int64, count=len(batch.seqs))
        chunks = np.asarray(batch.chunks, dtype=np.int64)
        seq_lens = starts + chunks
        if batch.decode:
            ids = np.fromiter((s.token_ids[-1] for s in batch.seqs), dtype=np.int64, count=len(batch.seqs))
            positions = starts
        else:
            ids = np.concatenate([s.token_ids[a : a + c] for s, a, c in zip(batch.seqs, starts, chunks)])
            positions = np.concatenate([np.arange(a, a + c) for a, c in zip(starts, chunks)])
        max_pages = int((seq_lens.max() + S - 1) // S)
        table = np.zeros((len(batch.seqs), max_pages), dtype=np.int32)
        for row, seq in zip(table, batch.seqs):
            row[: len(seq.pages)] = seq.pages[:max_pages]
        owner = np.repeat(np.arange(len(batch.seqs)), chunks)
        slots = table[owner, positions // S].astype(np.int64) * S + positions % S
        cu = np.zeros(len(batch.seqs) + 1, dtype=np.int32)
        np.cumsum(chunks, out=cu[1:])
        sampled = [i for i, s in enumerate(batch.seqs) if s.num_computed + batch.chunks[i] == s.num_tokens]
        attn = AttnBatch(
            decode=batch.decode,
            q_lens=batch.chunks,
            seq_lens_cpu=seq_lens.tolist(),
            page_table=self._to_device(table),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            cu_seqlens_q=self._to_device(cu),
            slot_mapping=self._to_device(slots),
            max_q_len=int(chunks.max()),
            max_seq_len=int(seq_lens.max()),
        )
        seqs = [batch.seqs[i] for i in sampled]
        sampling = (
            SamplingBatch.build(
                [s.params for s in seqs], [s.uniform() for s in seqs], self.vocab_size, self.device
            )
            if seqs
            else None
        )
        return StepInputs(
            self._to_device(ids),
            self._to_device(positions),
            attn,
            self._to_device(cu[1:][sampled].astype(np.int64) - 1),
            sampling,
        )

    @torch.inference_mode()
    def forward_logits(self, inputs: StepInputs) -> torch.Tensor:
        """float32 logits [N, vocab] for the rows that sample."""
        ctx = ForwardContext(self.backend, self.backend.begin(inputs.attn))
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        return self.model.logits(hidden[inputs.logit_rows])

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> StepOutput | None:
        inputs = self.prepare(batch)
        logits = self.forward_logits(inputs)
        if inputs.sampling is None:
            return None
        return to_host(sample(logits, inputs.sampling), inputs.sampling.num_top_logprobs)


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
