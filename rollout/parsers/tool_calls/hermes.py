"""Hermes (Qwen2.5, Qwen3, NousHermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call; the text around the blocks is content (vLLM's and SGLang's `hermes`/`qwen25`)."""

from __future__ import annotations

import json

from rollout.parsers.tool_calls.base import ToolCallFormat, only_calls, tagged_scan
from rollout.parsers.types import Piece, ToolCall, dump_arguments

START, END = "<tool_call>", "</tool_call>"


class Hermes(ToolCallFormat):
    name = "hermes"

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        return tagged_scan(text, final, START, END, self._block)

    @classmethod
    def opening(cls, function: str | None) -> str:
        head = START + "\n"
        return head if function is None else head + '{"name": ' + json.dumps(function) + ', "arguments": '

    def _block(self, body: str) -> list[ToolCall] | None:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        return only_calls([self._call(o) for o in (obj if isinstance(obj, list) else [obj])])

    def _call(self, obj: object) -> ToolCall | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not self.known(obj["name"]):
            return None
        args = dump_arguments(obj.get("arguments", obj.get("parameters", {})))
        return None if args is None else ToolCall(obj["name"], args)
