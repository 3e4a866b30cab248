"""What generate returns: one RequestOutput per prompt, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    # logprob of each sampled token (None when SamplingParams.logprobs is off)
    logprobs: list[float] | None
    # per sampled token, the top_logprobs most likely {token_id: logprob} (None when top_logprobs == 0)
    top_logprobs: list[dict[int, float]] | None
    finish_reason: FinishReason | None
    # the stop string or stop token that ended the sample, when one did
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt: str | None = None
