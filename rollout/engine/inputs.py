"""Checking a generate call's inputs before any work starts, and turning them into token lists."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

from rollout.sampling import SamplingParams


def normalize_prompts(
    prompts: Any, input_ids: Any, tokenizer: Any, add_special_tokens: bool | None = None
) -> tuple[list[list[int]], list[str] | None]:
    """One token list per prompt (and the texts when given as text). `add_special_tokens`: None
    encodes as the tokenizer does by default; False for text that already holds them (a chat
    template's output), so no second BOS is added."""
    if (prompts is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompts (text) or input_ids (token ids)")
    if prompts is not None:
        texts = [prompts] if isinstance(prompts, str) else prompts
        if not isinstance(texts, Seq) or not all(isinstance(p, str) for p in texts):
            raise TypeError(f"prompts must be a str or a list of str{_ids_hint(texts)}")
        if tokenizer is None:
            raise ValueError("prompts are text but the checkpoint has no tokenizer; pass input_ids instead")
        for i, text in enumerate(texts):
            if not text:
                raise ValueError(f"prompts[{i}] is empty")
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return [list(tokenizer.encode(t, **kwargs)) for t in texts], list(texts)
    ids = input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids
    if isinstance(ids, Seq) and ids and all(_is_int(t) for t in ids):
        ids = [ids]
    if not isinstance(ids, Seq) or not all(isinstance(p, Seq) and not isinstance(p, str) for p in ids):
        raise TypeError("input_ids must be a list of token ids or a list of such lists")
    return [list(p) for p in ids], None


def check_prompts(token_lists: list[list[int]], vocab_size: int) -> None:
    if not token_lists:
        raise ValueError("no prompts given")
    for i, tokens in enumerate(token_lists):
        if not tokens:
            raise ValueError(f"input_ids[{i}] is empty (a prompt needs at least one token)")
        _check_token_ids(i, tokens, vocab_size)


def _check_token_ids(i: int, tokens: list[Any], vocab_size: int) -> None:
    # C-level passes (type set, min, max) instead of a Python loop per token; the loop runs only to
    # name the offending entry
    if set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) < vocab_size:
        return  # exactly int: no bool, no float
    for t in tokens:
        if not _is_int(t):
            raise TypeError(f"input_ids[{i}] holds {t!r}, not an int token id")
        if not 0 <= t < vocab_size:
            raise ValueError(f"input_ids[{i}] holds token id {t}, outside the vocabulary [0, {vocab_size})")


def normalize_params(params: Any, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, Seq) or not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError("sampling_params must be a SamplingParams or a list of them")
    if len(params) != count:
        raise ValueError(f"sampling_params has {len(params)} entries for {count} prompts")
    return list(params)


def check_params(params: list[SamplingParams], vocab_size: int) -> None:
    """What SamplingParams cannot check alone: the fields that must fit the model's vocabulary."""
    for i, p in enumerate(params):
        for t in p.stop_token_ids or ():
            if t >= vocab_size:
                raise ValueError(
                    f"sampling_params[{i}].stop_token_ids holds {t}, outside the vocabulary [0, {vocab_size})"
                )
        for t in p.logit_bias or ():
            if t >= vocab_size:
                raise ValueError(
                    f"sampling_params[{i}].logit_bias holds token id {t}, "
                    f"outside the vocabulary [0, {vocab_size})"
                )
        for field_name, ids in (
            ("allowed_token_ids", p.allowed_token_ids or ()),
            ("bad_words_ids", [t for word in p.bad_words_ids or () for t in word]),
        ):
            for t in ids:
                if t >= vocab_size:
                    raise ValueError(
                        f"sampling_params[{i}].{field_name} holds token id {t}, "
                        f"outside the vocabulary [0, {vocab_size})"
                    )
        if p.top_logprobs > vocab_size:
            raise ValueError(
                f"sampling_params[{i}].top_logprobs={p.top_logprobs} exceeds the vocabulary size {vocab_size}"
            )


def check_lengths(
    token_lists: list[list[int]], params: list[SamplingParams], max_model_len: int, pool_tokens: int
) -> None:
    for i, (tokens, p) in enumerate(zip(token_lists, params)):
        total = len(tokens) + p.max_new_tokens
        if total > max_model_len:
            raise ValueError(
                f"prompt {i}: {len(tokens)} prompt tokens + max_new_tokens={p.max_new_tokens} "
                f"exceed max_model_len={max_model_len}"
            )
        if total > pool_tokens:
            raise ValueError(f"prompt {i}: {total} tokens cannot fit the KV pool of {pool_tokens} tokens")


def _ids_hint(prompts: Any) -> str:
    """Token ids passed as prompts: say where they go."""
    looks_like_ids = (
        isinstance(prompts, Seq)
        and prompts
        and all(
            _is_int(p) or (isinstance(p, Seq) and not isinstance(p, str) and all(_is_int(t) for t in p))
            for p in prompts
        )
    )
    return "; token ids go in input_ids= (generate(input_ids=[[5, 6, 7]]))" if looks_like_ids else ""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_inputs(
    prompts: Any,
    input_ids: Any,
    sampling_params: Any,
    add_special_tokens: bool | None,
    *,
    tokenizer: Any,
    vocab_size: int,
    max_model_len: int,
    pool_tokens: int,
    lora: Any,
) -> tuple[list[list[int]], list[str] | None, list[SamplingParams]]:
    """A generate call's prompts as token lists (and texts), and one checked SamplingParams each."""
    token_lists, texts = normalize_prompts(prompts, input_ids, tokenizer, add_special_tokens)
    check_prompts(token_lists, vocab_size)
    params = normalize_params(sampling_params, len(token_lists))
    check_params(params, vocab_size)
    check_lora_names(params, lora)
    check_lengths(token_lists, params, max_model_len, pool_tokens)
    if tokenizer is None and any(p.stop_strings for p in params):
        raise ValueError("SamplingParams.stop needs a tokenizer, and the checkpoint has none")
    return token_lists, texts, params


def check_lora_names(params: list[SamplingParams], lora: Any) -> None:
    """Each lora_name names a loaded adapter (`lora`: the LoraManager, None when LoRA is off)."""
    for p in params:
        if p.lora_name is not None and lora is None:
            raise ValueError(
                f"SamplingParams.lora_name={p.lora_name!r}: LoRA is off "
                "(start the engine with max_loras >= 1)"
            )
        if lora is not None:
            lora.check_name(p.lora_name)


def is_encoding(obj: Any) -> bool:
    """A tokenizer's BatchEncoding (or a plain dict shaped like one)."""
    return isinstance(obj, Mapping) and "input_ids" in obj


def encoding_ids(enc: Mapping) -> list[list[int]]:
    """A BatchEncoding's token lists, padding dropped by its attention_mask."""
    ids = enc["input_ids"]
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    if ids and not isinstance(ids[0], (list, tuple)):
        ids = [ids]  # one unbatched prompt
    mask = enc.get("attention_mask")
    if mask is None:
        return [list(p) for p in ids]
    mask = mask.tolist() if hasattr(mask, "tolist") else mask
    if mask and not isinstance(mask[0], (list, tuple)):
        mask = [mask]
    return [[t for t, m in zip(p, row) if m] for p, row in zip(ids, mask)]  # padding out


def check_sent_counts(rid: Hashable, counts: Any, samples: int) -> None:
    """token_deltas' `sent[rid]`: one count of output tokens already sent per sample, each >= 0."""
    if not isinstance(counts, list) or len(counts) != samples:
        raise ValueError(f"sent[{rid!r}] must be a list of {samples} output-token counts, one per sample")
    # checked for every streamed request between two steps: a comprehension, cheaper than any(genexpr)
    if [c for c in counts if isinstance(c, bool) or not isinstance(c, int) or c < 0]:
        raise ValueError(f"sent[{rid!r}] holds a count that is not an int >= 0: {counts}")
