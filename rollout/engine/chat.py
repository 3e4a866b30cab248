"""The tokenizer side of the engine: loading the checkpoint's tokenizer, its EOS, and chat rendering
(`Engine.chat`: conversations through the tokenizer's chat template)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def load_tokenizer(path: str) -> Any:
    """The checkpoint folder's tokenizer, or None when it ships none."""
    folder = Path(path)
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokenizer_eos(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's EOS id, for checkpoints whose config names none."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return (eos,) if isinstance(eos, int) else ()


def render_chat(tokenizer: Any, conversation: list[dict[str, Any]], kwargs: dict[str, Any] | None) -> str:
    """One conversation as the chat template writes it, with the generation prompt added."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer, and the checkpoint has none")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat: the tokenizer has no chat template (set tokenizer.chat_template)")
    options = {"add_generation_prompt": True, **(kwargs or {})}
    return tokenizer.apply_chat_template(conversation, tokenize=False, **options)


def conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """`chat`'s messages as a list of conversations (one conversation, or a list of them)."""
    if _is_conversation(messages):
        return [list(messages)]
    if isinstance(messages, (list, tuple)) and messages and all(_is_conversation(c) for c in messages):
        return [list(c) for c in messages]
    raise TypeError("messages must be a list of {'role', 'content'} dicts, or a non-empty list of such lists")


def _is_conversation(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and bool(obj) and all(isinstance(m, Mapping) for m in obj)
