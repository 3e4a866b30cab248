"""Per-request bounds, checked before any work starts (docs/reliability.md).

One request must not be able to take the engine worker's memory: `n=10**6` once grew the worker until
the kernel killed it. Every multiplicity a client chooses is bounded by a server flag, and a request
past a bound is a 400 naming the client's field.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.serve.errors import ApiError


@dataclass(frozen=True)
class Bounds:
    """The server's bounds (flags of `python -m rollout.serve`)."""

    max_n: int = 64  # --max-n: samples per prompt (n)
    max_top_logprobs: int = 20  # --max-top-logprobs: alternatives per token (OpenAI's cap too)
    max_prompts: int = 256  # --max-prompts-per-request: prompts of one batched request
    max_request_tokens: int = 1 << 20  # --max-request-tokens: sum over prompts of n * (prompt + max_tokens)

    def __post_init__(self) -> None:
        for name in ("max_n", "max_top_logprobs", "max_prompts", "max_request_tokens"):
            value, low = getattr(self, name), 0 if name == "max_top_logprobs" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Bounds.{name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class Names:
    """The client's names for the fields bounded (they differ between OpenAI's and SGLang's APIs)."""

    n: str = "n"
    max_tokens: str = "max_tokens"
    top_logprobs: str = "top_logprobs"
    prompts: str = "prompt"


def check_counts(bounds: Bounds, names: Names, *, n: int, top_logprobs: int, prompts: int) -> None:
    """The multiplicities known before the prompts are tokenised."""
    if n > bounds.max_n:
        raise ApiError(
            400, f"{names.n} must be <= {bounds.max_n} on this server (--max-n), got {n}", param=names.n
        )
    if top_logprobs > bounds.max_top_logprobs:
        raise ApiError(
            400,
            f"{names.top_logprobs} must be <= {bounds.max_top_logprobs} on this server (--max-top-logprobs), "
            f"got {top_logprobs}",
            param=names.top_logprobs,
        )
    if prompts > bounds.max_prompts:
        raise ApiError(
            400,
            f"{names.prompts}: {prompts} prompts in one request; this server takes up to "
            f"{bounds.max_prompts} "
            "(--max-prompts-per-request)",
            param=names.prompts,
        )


def check_tokens(
    bounds: Bounds, names: Names, *, prompt_lens: list[int], n: int, max_tokens: int, max_model_len: int
) -> None:
    """max_tokens against the context, and the request's whole token budget."""
    if max_tokens < 1:
        raise ApiError(400, f"{names.max_tokens} must be >= 1, got {max_tokens}", param=names.max_tokens)
    for i, length in enumerate(prompt_lens):
        if length + max_tokens > max_model_len:
            which = f" (prompt {i})" if len(prompt_lens) > 1 else ""
            raise ApiError(
                400,
                f"{names.max_tokens}={max_tokens} plus the prompt's {length} tokens{which} exceed the "
                "model's "
                f"context of {max_model_len} tokens",
                param=names.max_tokens,
            )
    total = sum(n * (length + max_tokens) for length in prompt_lens)
    if total > bounds.max_request_tokens:
        raise ApiError(
            400,
            f"{names.max_tokens}: the request needs up to {total} tokens (n * (prompt + max_tokens) over its "
            f"prompts); this server takes up to {bounds.max_request_tokens} per request "
            "(--max-request-tokens)",
            param=names.max_tokens,
        )
