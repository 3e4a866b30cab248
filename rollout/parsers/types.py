"""What the parsers return: typed pieces of a model's output, in the order the model wrote them."""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any


def call_id() -> str:
    """An OpenAI-style tool-call id (vLLM and SGLang send `call_` + hex as well)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's templates require 9 alphanumeric characters."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    """One function call; `arguments` is a JSON string, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


Piece = Content | Reasoning | ToolCall


@dataclass(frozen=True)
class Parsed:
    """A whole output split: the visible content (stripped beside tool calls; None when empty), the
    calls, and the reasoning (None when there was none)."""

    content: str | None
    tool_calls: list[ToolCall]
    reasoning: str | None = None


def gather(pieces: list[Piece]) -> Parsed:
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    reasoning = [p.text for p in pieces if isinstance(p, Reasoning)]
    if calls:  # the white space around call blocks is the format's, not the model's answer
        content = content.strip()
    return Parsed(content or None, calls, "".join(reasoning) if reasoning else None)


def dump_arguments(args: Any) -> str | None:
    """Arguments as the JSON string OpenAI sends (an object), or None when they are not an object."""
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def held_prefix(text: str, start: int, marker: str) -> int:
    """Where the tail of text[start:] that could still grow into `marker` begins (len(text) if none):
    a stream keeps that tail back until the next chunk tells."""
    for k in range(max(start, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[k:]):
            return k
    return len(text)
