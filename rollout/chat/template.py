"""Prompts from chat messages through the checkpoint's chat template, and token-exact continuations.

A continuation never re-renders the earlier turns: turn k+1's prompt is turn k's prompt ids, plus the
ids turn k sampled, plus the ids of what the template writes after the end of that assistant turn (the
new tool results or user message, and the next generation prompt). Re-tokenizing the text of earlier
turns can give other ids than the ones sampled (BPE merges across the boundaries, templates that
rewrite or drop earlier reasoning), and the trainer would then score tokens the policy never sampled.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from rollout.chat.tools import Choice
from rollout.parsers import tool_format
from rollout.parsers.reasoning import prompt_opens_thinking


@dataclass(frozen=True)
class Prompt:
    """What to generate from: the ids, and the text the output continues (a prefilled tool-call
    opening, parsed with the output; empty when none) and whether the prompt left <think> open."""

    token_ids: list[int]
    prefill: str = ""
    thinking_open: bool = False


def render(
    tok: Any,
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    kwargs: dict[str, Any] | None,
    generation_prompt: bool = True,
) -> str:
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError("messages: the model's tokenizer has no chat template; use /v1/completions")
    options = dict(kwargs or {})
    # template variables only: apply_chat_template's own parameters (the template itself, tokenizing,
    # tensors) are the server's
    reserved = set(inspect.signature(tok.apply_chat_template).parameters) - {"kwargs"}
    taken = reserved & set(options)
    if taken:
        raise ValueError(f"chat_template_kwargs: {', '.join(sorted(taken))} is set by the server")
    try:
        return tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False, **options
        )
    except Exception as e:  # jinja errors raised by the template itself (raise_exception) are the input's
        raise ValueError(f"messages: the chat template refused them: {e}") from e


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def prefill(parser: str | None, choice: Choice) -> str:
    """For tool_choice "required" or a named function: the call's opening, written into the prompt so
    the model goes on with the call (no constrained decoding; a model that then writes a broken call
    gets it back as content)."""
    if not choice.required:
        return ""
    if parser is None:
        raise ValueError("tool_choice: required or named calls need the server's --tool-call-parser")
    return tool_format(parser).opening(choice.function)


def first_prompt(
    tok: Any, messages: list[dict], tools: list[dict] | None, kwargs: dict | None, opening: str = ""
) -> Prompt:
    text = render(tok, messages, tools, kwargs)
    return Prompt(encode(tok, text + opening), opening, prompt_opens_thinking(text))


def continuation(
    tok: Any,
    messages: list[dict],
    raw_messages: list[dict],
    prompt_ids: list[int],
    tools: list[dict] | None,
    kwargs: dict | None,
    opening: str = "",
) -> Prompt:
    """Turn k+1's prompt: `prompt_ids` (turn k's prompt) + the last assistant message's `token_ids` (as
    sampled) + the ids of the messages after it, as the template renders them after that turn's end.
    `messages` are ready for the template; `raw_messages` are the request's (with token_ids)."""
    last = max((i for i, m in enumerate(raw_messages) if m.get("role") == "assistant"), default=None)
    if last is None or "token_ids" not in raw_messages[last]:
        raise ValueError("prompt_token_ids: needs the last assistant message's token_ids (as it was sampled)")
    sampled = _ids(raw_messages[last]["token_ids"], f"messages[{last}].token_ids")
    prompt_ids = _ids(prompt_ids, "prompt_token_ids")
    for i, m in enumerate(raw_messages[:last]):
        if m.get("role") == "assistant" and "token_ids" in m:
            if not _contains(prompt_ids, _ids(m["token_ids"], f"messages[{i}].token_ids")):
                raise ValueError(f"messages[{i}].token_ids: not in prompt_token_ids (another conversation?)")
    base = render(tok, messages[: last + 1], tools, kwargs, generation_prompt=False)
    full = render(tok, messages, tools, kwargs)
    tail = _after_turn(tok, base, full, sampled)
    return Prompt(prompt_ids + sampled + encode(tok, tail + opening), opening, prompt_opens_thinking(full))


def _after_turn(tok: Any, base: str, full: str, sampled: list[int]) -> str:
    """The text `full` has after the end of the last assistant turn of `base`. That end is the template's
    end-of-turn marker: the sampled ids hold it when the model ended the turn itself (its last token),
    else the template's marker starts the tail. The marker is found by count, not by comparing the
    texts: templates may render earlier turns differently once later ones follow (Qwen3 drops the
    reasoning of turns before the last user message)."""
    last_text = tok.decode(sampled[-1:], skip_special_tokens=False) if sampled else ""
    ended = (
        bool(last_text) and sampled[-1] in set(tok.all_special_ids) | _added_ids(tok) and last_text in base
    )
    marker = last_text if ended else (tok.eos_token or "")
    if not marker or marker not in base:
        raise ValueError(
            "messages: cannot find where the chat template ends an assistant turn "
            f"(no {marker!r} in its rendering), so the new messages cannot be placed after the sampled ids"
        )
    count = base.count(marker)
    at = _nth(full, marker, count)
    if at < 0:
        raise ValueError("messages: the chat template renders fewer turns once the new messages follow")
    cut = at + len(marker) if ended else at
    if not full[cut:].startswith(base[base.rfind(marker) + (len(marker) if ended else 0) :]):
        raise ValueError(
            "messages: the chat template renders the end of the last assistant turn differently once "
            "new messages follow, so its ids cannot be kept as sampled"
        )
    return full[cut:]


def _added_ids(tok: Any) -> set[int]:
    return set(getattr(tok, "added_tokens_decoder", {}) or {})


def _nth(text: str, marker: str, n: int) -> int:
    at = -1
    for _ in range(n):
        at = text.find(marker, at + 1)
        if at < 0:
            return -1
    return at


def _contains(seq: list[int], sub: list[int]) -> bool:
    n = len(sub)
    return n == 0 or any(seq[i : i + n] == sub for i in range(len(seq) - n + 1))


def _ids(value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{field}: must be a list of token ids")
    return value


def chat_prompt(
    tok: Any,
    raw_messages: list[dict],
    messages: list[dict],
    tools: list[dict] | None,
    kwargs: dict | None,
    prompt_ids: list[int] | None,
    opening: str = "",
) -> Prompt:
    """The first turn's prompt, or a continuation when the caller gave turn k's prompt ids."""
    if prompt_ids is None:
        return first_prompt(tok, messages, tools, kwargs, opening)
    return continuation(tok, messages, raw_messages, prompt_ids, tools, kwargs, opening)
