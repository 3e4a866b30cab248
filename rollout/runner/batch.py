"""The types a step hands between the scheduler, the runner and its CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollout.attention.base import AttnBatch
from rollout.runner.sampler import SamplingBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn: AttnBatch
    logit_rows: torch.Tensor | slice  # rows of the hidden states whose next token is sampled
    sampling: SamplingBatch | None
    graph_bs: int | None = None  # set when a captured graph runs the step (tensors are its buffers)
    lora_slots: torch.Tensor | None = None  # int64 [T]: each token's LoRA slot (None: no adapter used)
    state: Any = None  # a cache.state.StateBatch when the model keeps per-request state


@dataclass
class HostBatch:
    """One step's integers on the host (numpy), before they go to the device."""

    decode: bool
    ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [T]
    seq_lens: np.ndarray  # int64 [B]
    q_lens: list[int]
    page_table: np.ndarray  # int32 [B, max_pages]
    sampled: np.ndarray  # int64 [N]: batch rows that sample a token this step
    token_slots: np.ndarray | None = None  # int64 [T]: LoRA slot per token (None: every token on the base)
    state_slots: np.ndarray | None = None  # int64 [B]: each sequence's state slot (models with state)
    fresh: np.ndarray | None = None  # bool [B]: its chunk starts at token 0 (a zero state)
    # a decode step of the same sequences as the last one, run the same way (the same CUDA graph, or
    # eagerly): its LoRA slots are as then, and with same_pages its page table too (no sequence entered a
    # new page), so a graph's copies of them may be skipped
    same_seqs: bool = False
    same_pages: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)


@dataclass
class StepOutput:
    """Host-side results of one step for the sequences that sampled (in batch order)."""

    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float]] | None
    prompt: dict[int, Any] | None = None  # batch index -> scoring.PromptPiece (logprobs of given tokens)
    ranks: list[int] | None = None  # the sampled tokens' ranks (SamplingParams.logprob_ranks)
