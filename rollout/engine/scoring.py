"""The host half of `Engine.score`: input checks, grouping, and the answer type.

The logprobs themselves are computed by the runner (rollout/runner/prompt_logprobs.py) in the prefill
chunks that the scheduler plans for sequences carrying `logprobs_from`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ScoreOutput:
    """`Engine.score`'s answer for one sequence: logprobs[j] is the logprob of token_ids[start + j]."""

    token_ids: list[int]
    start: int
    logprobs: list[float]
    # per scored token, the top_logprobs most likely {token_id: logprob} (None when top_logprobs == 0)
    top_logprobs: list[dict[int, float]] | None = None


def check_score_inputs(
    token_lists: list[list[int]],
    start: object,
    top_logprobs: object,
    temperature: object,
    max_model_len: int,
    pool_tokens: int,
) -> list[int]:
    """Each sequence's first scored index (1 <= start < len); the lengths must fit the engine."""
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise ValueError(f"top_logprobs must be an int >= 0, got {top_logprobs!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    n = len(token_lists)
    if start is None:
        starts = [1] * n
    elif isinstance(start, int) and not isinstance(start, bool):
        starts = [start] * n
    elif isinstance(start, (list, tuple)) and all(
        isinstance(s, int) and not isinstance(s, bool) for s in start
    ):
        if len(start) != n:
            raise ValueError(f"start has {len(start)} entries for {n} sequences")
        starts = list(start)
    else:
        raise TypeError(f"start must be an int, a list of ints or None, got {type(start).__name__}")
    for i, (tokens, s) in enumerate(zip(token_lists, starts)):
        if not 1 <= s < len(tokens):
            raise ValueError(
                f"start={s} for sequence {i} of {len(tokens)} tokens: it must be in [1, {len(tokens)})"
            )
        if len(tokens) > min(max_model_len, pool_tokens):
            raise ValueError(
                f"sequence {i}: {len(tokens)} tokens exceed max_model_len={max_model_len} "
                f"or the KV pool of {pool_tokens} tokens"
            )
    return starts


def score_groups(token_lists: list[list[int]], starts: list[int]) -> list[list[int]]:
    """Sequence indices grouped by their unscored prefix (token_ids[:start]), in first-seen order: a
    group is one request, its first member computes the prefix and the others share its pages."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (tokens, s) in enumerate(zip(token_lists, starts)):
        groups.setdefault(tuple(tokens[:s]), []).append(i)
    return list(groups.values())


def score_output(seq, top_logprobs: int) -> ScoreOutput:
    return ScoreOutput(
        token_ids=list(seq.token_ids),
        start=seq.scoring.start,
        logprobs=list(seq.scoring.logprobs),
        top_logprobs=list(seq.scoring.top) if top_logprobs else None,
    )
