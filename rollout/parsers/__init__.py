"""Tool-call and reasoning parsers, by name, for the server (--tool-call-parser, --reasoning-parser)
and for Python callers:

    from rollout.parsers import tool_parser, reasoning_parser
    tool_parser("hermes", tools=["get_weather"]).parse(text)   # Parsed(content, tool_calls, ...)
    reasoning_parser("qwen3").parse(text)                      # Parsed(content, [], reasoning)
    Stream(tool_parser("hermes")).feed(chunk)                  # the pieces sure so far

A tool call whose text does not parse, or names a function the request did not offer, is content,
never an exception.

May import: nothing of rollout outside parsers/.
"""

from __future__ import annotations

from collections.abc import Iterable

from rollout.parsers.reasoning import DeepSeekR1, Qwen3, ReasoningFormat
from rollout.parsers.stream import Stream, parse_chunks
from rollout.parsers.tool_calls import FORMATS, ToolCallFormat
from rollout.parsers.types import Content, Parsed, Piece, Reasoning, ToolCall

REASONING: dict[str, type[ReasoningFormat]] = {f.name: f for f in (Qwen3, DeepSeekR1)}


def tool_parser_names() -> list[str]:
    return sorted(FORMATS)


def reasoning_parser_names() -> list[str]:
    return sorted(REASONING)


def tool_format(name: str) -> type[ToolCallFormat]:
    """The format class called `name`; a ValueError listing the known ones when there is none."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(tool_parser_names())}")
    return FORMATS[name]


def reasoning_format(name: str) -> type[ReasoningFormat]:
    if name not in REASONING:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(reasoning_parser_names())}")
    return REASONING[name]


def tool_parser(
    name: str, tools: Iterable[str] | None = None, schemas: dict[str, dict] | None = None
) -> ToolCallFormat:
    """A fresh parser for one output: `tools` the offered function names (None: any)."""
    return tool_format(name)(tools, schemas)


def reasoning_parser(name: str, started: bool = False) -> ReasoningFormat:
    """A fresh parser for one output; started: the prompt left a <think> open."""
    return reasoning_format(name)(started)


__all__ = [
    "Content",
    "Parsed",
    "Piece",
    "Reasoning",
    "Stream",
    "ToolCall",
    "parse_chunks",
    "reasoning_parser",
    "reasoning_parser_names",
    "tool_parser",
    "tool_parser_names",
]
