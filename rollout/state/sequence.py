"""One request (a prompt and its n samples), and one sample being generated: its tokens, its pages in
the KV cache, and how it ended."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from rollout.outputs import FinishReason
from rollout.sampling import SamplingParams

MASK64 = (1 << 64) - 1
PENDING = -1  # in token_ids: the token a step still in flight samples (Sequence.pending)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class StopState:
    """How a sequence stopped, and its text while stop strings are checked or it streams."""

    reason: str | int | None = None  # the stop string or token id that ended it
    text: str = ""  # set when a stop string cut the output
    detok: Any = None  # an IncrementalText, made by the first stop-string check or streamed delta


@dataclass(eq=False)
class Streamed:
    """What stream deltas have handed out of a sequence."""

    tokens: int = 0  # output tokens
    chars: int = 0  # characters of text


@dataclass(eq=False)
class Scoring:
    """Logprobs of given tokens (engine/scoring.py, runner/prompt_logprobs.py): those of tokens
    `start`, start + 1, ... of the sequence, computed by its prefill."""

    start: int  # the index of the first token to score
    only: bool = False  # Engine.score: finish after the prefill, sample nothing
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)  # each token's top_logprobs
    ranks: list[int] = field(default_factory=list)  # with SamplingParams.logprob_ranks


@dataclass(eq=False)
class Sequence:
    """One sample being generated. The fields the step reads are flat; the rest are grouped by concern
    (stop, streamed, scoring)."""

    seq_id: int
    request_id: Hashable
    sample: int  # which of the prompt's n samples
    token_ids: list[int]  # prompt + generated so far
    num_prompt: int
    params: SamplingParams
    seed: int
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    pages: list[int] = field(default_factory=list)
    num_indexed_pages: int = 0  # leading pages registered in the prefix cache
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    logprob_ranks: list[int] = field(default_factory=list)  # with SamplingParams.logprob_ranks
    weight_versions: list[int] = field(default_factory=list)  # the weight version that sampled each token
    finish_reason: FinishReason | None = None
    stop: StopState = field(default_factory=StopState)
    streamed: Streamed = field(default_factory=Streamed)
    # the prompt's other samples wait for this one's prefill, then share its cached prompt pages
    followers: list[Sequence] = field(default_factory=list)
    scoring: Scoring | None = None  # logprobs of given tokens: prompt_logprobs, Engine.score
    cache_salt: Hashable = None  # prefix-cache chain of its LoRA adapter (None: the base model's)
    # token_ids[-1] is PENDING: a launched step samples it, and postprocess puts it in place
    pending: bool = False
    # with SamplingParams.return_routed_experts: routes of tokens 0.. read back when pages were freed
    # (int32 [n, moe layers, top_k] pieces; a preemption keeps those computed before it)
    routes: list[Any] = field(default_factory=list)
    num_routes: int = 0  # rows in `routes`
    # models with per-request state (cache/state.py): the snapshot slot its state starts from, set when
    # it shares a cached prefix; the runner copies it into the sequence's own slot before its first chunk
    state_from: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def needs(self) -> int:
        """Tokens to compute before the next one can be sampled (1 while decoding)."""
        return len(self.token_ids) - self.num_computed


@dataclass(eq=False)
class Request:
    """What add_request was given, and the n sequences that sample it."""

    request_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    prompt: str | None = None  # the text, when given as text
    stream: bool = False  # step() reports every advance as a delta, not only the end

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.seqs)


_U64 = [
    np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xD1B54A32D192ED03, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
]


def uniforms(seqs: list[Sequence]) -> np.ndarray:
    """The random number each sequence samples its next token with (float64 [N] in (0, 1)): a
    splitmix64 hash of (seed, output index), so a sample is the same whatever else is in the batch,
    and after preemption and recompute. uint64 numpy arithmetic wraps modulo 2**64."""
    return hashed_uniforms(seeds(seqs), draws(seqs))


def seeds(seqs: list[Sequence]) -> np.ndarray:
    return np.fromiter((s.seed & MASK64 for s in seqs), dtype=np.uint64, count=len(seqs))


def draws(seqs: list[Sequence]) -> np.ndarray:
    """uint64 [N]: the output index of each sequence's next token (1 for the first)."""
    return np.fromiter((len(s.token_ids) - s.num_prompt + 1 for s in seqs), dtype=np.uint64, count=len(seqs))


def hashed_uniforms(seed: np.ndarray, draw: np.ndarray) -> np.ndarray:
    """`uniforms` from uint64 seeds and draw indices (a decode batch keeps both and adds 1 a step)."""
    x = seed * _U64[0] + draw * _U64[1]
    x = (x ^ (x >> np.uint64(30))) * _U64[2]
    x = (x ^ (x >> np.uint64(27))) * _U64[3]
    x ^= x >> np.uint64(31)
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
