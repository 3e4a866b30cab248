"""Formats where the whole output is the call(s) or plain content, decided by how it starts (Llama 3's
JSON, the pythonic lists of Llama 3.2/4): a stream holds the text once it starts like a call and
parses it at the end; if it does not parse, all of it is content."""

from __future__ import annotations

import abc

from rollout.parsers.tool_calls.base import ToolCallFormat
from rollout.parsers.types import Content, Piece, ToolCall


class WholeOutputFormat(ToolCallFormat):
    starts: tuple[str, ...] = ()  # what a call output begins with (after white space)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mode: str | None = None  # "calls" or "content", once the start tells

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        if self.mode is None:
            head = text.lstrip()
            if any(head.startswith(s) for s in self.starts):
                self.mode = "calls"
            elif not final and (not head or any(s.startswith(head) for s in self.starts)):
                return [], 0  # too short to tell
            else:
                self.mode = "content"
        if self.mode == "content":
            return ([Content(text)] if text else []), len(text)
        if not final:
            return [], 0
        calls = self.calls(text.strip())
        return (calls if calls else [Content(text)]), len(text)

    @abc.abstractmethod
    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls the whole output is, or None."""
