"""Per-request sampling parameters, validated when they are made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this a temperature overflows float32 logits (logit / temperature) or rounds to 0 on the device,
# where the row would turn greedy while the host still treats it as sampled: use 0 for greedy.
MIN_TEMPERATURE = 1e-6
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completions of one prompt.

    Logits pass, as in vLLM: min_tokens masking and logit_bias, then the penalties, then temperature,
    then top-k / top-p / min-p truncation. ``repetition_penalty`` (HF/vLLM) divides the positive logits
    and multiplies the negative ones of every token in the prompt or output; ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI/vLLM) subtract ``presence * (count > 0) + frequency * count`` over the
    output tokens. ``min_tokens`` masks EOS (unless ignore_eos) and stop_token_ids, and ignores stop
    strings, until that many tokens are out.

    logprobs_mode="raw" (default): a sampled token's logprob is ``log_softmax(logits / temperature)[token]``
    (plain ``log_softmax`` at temperature 0) of the model's logits, before penalties, bias and truncation:
    what a trainer recomputes. "processed": the log-probability under the distribution the token was
    drawn from (after penalties, bias, temperature and truncation, renormalised; never -inf for a
    sampled token); greedy rows report ``log_softmax`` of the penalised, biased logits. top_logprobs
    follow the same mode.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    # None: off; k >= 0: RequestOutput.prompt_logprobs holds the logprob of every prompt token after the
    # first (at this temperature, as for sampled tokens), and with k > 0 the top k of each position too
    prompt_logprobs: int | None = None
    lora_name: str | None = None  # the LoRA adapter (Engine.load_lora_adapter) to sample with; None: base
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)  # token id -> added to its logit
    include_stop_str_in_output: bool = False
    logprobs_mode: str = "raw"  # "raw" | "processed", see above
    # MoE models: CompletionOutput.routed_experts, the experts every MoE layer chose for every token
    # (needs Engine(..., enable_return_routed_experts=True); see docs/moe.md)
    return_routed_experts: bool = False
    # only these tokens may be sampled (vLLM's allowed_token_ids); None: all
    allowed_token_ids: list[int] | None = field(default=None, hash=False)
    # token sequences never completed (vLLM's bad_words, tokenized): the last token of one is masked
    # whenever the output so far ends with the rest of it
    bad_words_ids: list[list[int]] | None = field(default=None, hash=False)
    # with logprobs (prompt_logprobs): CompletionOutput.logprob_ranks (RequestOutput.prompt_logprob_ranks)
    # holds each token's rank in the reported distribution (tokens at least as likely, itself included;
    # 1 = the most likely)
    logprob_ranks: bool = False
    _stop: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, low=1)
        _check_number("temperature", self.temperature)
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature):
            raise ValueError(
                f"SamplingParams.temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                f"got {self.temperature}"
            )
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1), got {self.min_p}")
        _check_int("max_new_tokens", self.max_new_tokens, low=1)
        _check_int("top_logprobs", self.top_logprobs, low=0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        for name in ("ignore_eos", "logprobs", "skip_special_tokens", "return_routed_experts"):
            _check_bool(name, getattr(self, name))
        object.__setattr__(self, "_stop", _stop_strings(self.stop))
        if self.stop_token_ids is not None:
            _check_list("stop_token_ids", self.stop_token_ids)
            for t in self.stop_token_ids:
                _check_int("stop_token_ids", t, low=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0)
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise TypeError(
                f"SamplingParams.lora_name must be a non-empty str or None, got {self.lora_name!r}"
            )
        self._check_logit_options()

    def _check_logit_options(self) -> None:
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_number("presence_penalty", self.presence_penalty)
        _check_number("frequency_penalty", self.frequency_penalty)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens={self.min_tokens} exceeds max_new_tokens={self.max_new_tokens}"
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(
                    f"SamplingParams.logit_bias must be a dict, got {type(self.logit_bias).__name__}"
                )
            for t, b in self.logit_bias.items():
                _check_int("logit_bias", t, low=0)
                _check_number("logit_bias", b)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("logprob_ranks", self.logprob_ranks)
        if self.logprob_ranks and not self.logprobs and self.prompt_logprobs is None:
            raise ValueError("SamplingParams.logprob_ranks needs logprobs=True or prompt_logprobs")
        if self.allowed_token_ids is not None:
            _check_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("SamplingParams.allowed_token_ids must not be empty (None: every token)")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, low=0)
        if self.bad_words_ids is not None:
            _check_list("bad_words_ids", self.bad_words_ids)
            for word in self.bad_words_ids:
                _check_list("bad_words_ids", word)
                if not word:
                    raise ValueError("SamplingParams.bad_words_ids entries must hold at least one token")
                for t in word:
                    _check_int("bad_words_ids", t, low=0)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"SamplingParams.logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop

    @property
    def stream_holdback(self) -> int:
        """Characters a stream keeps back while unfinished: a stop string cut from the output may have
        begun in them (at most its length less one), and text once streamed cannot be taken back."""
        if not self._stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self._stop) - 1

    @property
    def sample_ranks(self) -> bool:
        """Whether the sampler computes the sampled tokens' ranks."""
        return self.logprob_ranks and self.logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_sort(self) -> bool:
        """Whether truncation needs the sorted distribution (top-k or top-p)."""
        return not self.greedy and (self.top_k != -1 or self.top_p < 1.0)

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before temperature (a per-batch flag)."""
        return (
            self.needs_penalties
            or self.min_tokens > 0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words_ids)
        )


def _check_int(name: str, value: object, low: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"SamplingParams.{name} must be >= {low}, got {value}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"SamplingParams.{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):  # NaN passes every range check below, inf overflows the sampler
        raise ValueError(f"SamplingParams.{name} must be a finite number, got {value}")


def _check_bool(name: str, value: object) -> None:
    # strictly bool: "no" or "false" is truthy, so anything else would be read the wrong way round
    if not isinstance(value, bool):
        raise TypeError(f"SamplingParams.{name} must be a bool, got {type(value).__name__} {value!r}")


def _check_list(name: str, value: object) -> None:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"SamplingParams.{name} must be a list, got {type(value).__name__} {value!r}")


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise TypeError(f"SamplingParams.stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(stop)
