"""The common shape of the tool-call parsers: a scanner over the output text that returns the pieces it
is sure of and how much text they cover. The same scanner serves a whole output (final=True) and a
stream (fed chunk by chunk, the unsure tail kept back), so both give the same pieces."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable

from rollout.parsers.types import Content, Parsed, Piece, ToolCall, gather, held_prefix


class ToolCallFormat(abc.ABC):
    """One model family's tool-call syntax. A new instance per output: scanners may keep state."""

    name: str = ""

    def __init__(self, tools: Iterable[str] | None = None, schemas: dict[str, dict] | None = None):
        # tools: the function names the request offered (None: any name); schemas: name -> parameters
        self.tools = None if tools is None else frozenset(tools)
        self.schemas = schemas or {}

    def known(self, name: str) -> bool:
        return bool(name) and (self.tools is None or name in self.tools)

    @abc.abstractmethod
    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        """The pieces text[:consumed] surely is, and consumed; with final=True, all of it."""

    @classmethod
    def opening(cls, function: str | None) -> str:
        """The text that starts a call (of `function`, when named): prefilled for tool_choice
        "required" or a named function, so the model writes the rest."""
        raise NotImplementedError(f"{cls.name}: no opening to prefill")

    def parse(self, text: str) -> Parsed:
        pieces, _ = self.scan(text, final=True)
        return gather(pieces)


def tagged_scan(
    text: str, final: bool, start: str, end: str | None, body: Callable[[str], list[ToolCall] | None]
) -> tuple[list[Piece], int]:
    """Content around `start`...`end` blocks; a block whose body parses is a call, else content. With no
    end tag (or an unclosed last block), the block runs to the end of the output."""
    pieces: list[Piece] = []
    i = 0
    while i < len(text):
        j = text.find(start, i)
        if j < 0:
            k = len(text) if final else held_prefix(text, i, start)
            if k > i:
                pieces.append(Content(text[i:k]))
            i = k
            break
        if j > i:
            pieces.append(Content(text[i:j]))
        e = text.find(end, j + len(start)) if end else -1
        if e < 0:
            if not final:
                return pieces, j
            calls = body(text[j + len(start) :])
            pieces += calls if calls else [Content(text[j:])]
            return pieces, len(text)
        calls = body(text[j + len(start) : e])
        pieces += calls if calls else [Content(text[j : e + len(end)])]
        i = e + len(end)
    return pieces, i


def only_calls(calls: list[ToolCall | None]) -> list[ToolCall] | None:
    """All of them, or None when any failed (the block then reads as content)."""
    return None if not calls or any(c is None for c in calls) else list(calls)
