"""What the engine returns: one RequestOutput per request, one CompletionOutput per sample."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

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
    # the weight version that sampled each token: a partial rollout resumed over an update mixes versions
    weight_versions: list[int] = field(default_factory=list)
    # with SamplingParams.return_routed_experts (MoE models): int32 tensor [prompt + output tokens - 1,
    # MoE layers, top_k], the experts each MoE layer chose for each token in the forward that computed it
    routed_experts: Any = None
    # with SamplingParams.logprob_ranks: each sampled token's rank (1 = the most likely), else None
    logprob_ranks: list[int] | None = None


@dataclass
class RequestOutput:
    """A request's samples. From `generate`, and from `step` for a finished request, each sample holds
    its whole output; for a streamed request `step` reports deltas: the tokens, logprobs and text
    added since the request's previous output (`finished` tells the last one)."""

    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt: str | None = None
    request_id: Hashable = None
    finished: bool = True
    # with SamplingParams.prompt_logprobs: the logprob of prompt tokens 1.. (the first has none) and,
    # when it is > 0, the top ones of each position
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[dict[int, float]] | None = None
    # with SamplingParams.logprob_ranks too: each scored prompt token's rank (1 = the most likely)
    prompt_logprob_ranks: list[int] | None = None


class TokenDelta(NamedTuple):
    """The tokens one sample of a request gained since some point (`Engine.token_deltas`), with no text:
    the caller decodes them. A tuple, not a dataclass: hundreds cross a process pipe per step, and
    tuples pickle smaller and faster."""

    request_id: Hashable
    sample: int
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    weight_versions: list[int]
    finish_reason: str | None  # set when this sample ended while others of its request go on
    stop_reason: str | int | None
    stop_text: str | None  # the text a stop string cut, when one did (the parent cannot know it)
