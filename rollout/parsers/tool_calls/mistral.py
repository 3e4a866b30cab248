"""Mistral: `[TOOL_CALLS]` then a JSON list of {"name", "arguments"} (v3 tokenizers), or
`[TOOL_CALLS]name[ARGS]{...}` per call (v11+); the text before it is content. Ids are 9 alphanumeric
characters, as Mistral's templates require (vLLM does the same)."""

from __future__ import annotations

import json

from rollout.parsers.tool_calls.base import ToolCallFormat, only_calls, tagged_scan
from rollout.parsers.types import Piece, ToolCall, dump_arguments, mistral_call_id

START, ARGS = "[TOOL_CALLS]", "[ARGS]"


class Mistral(ToolCallFormat):
    name = "mistral"

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        return tagged_scan(text, final, START, None, self._tail)

    @classmethod
    def opening(cls, function: str | None) -> str:
        return START if function is None else f"{START}{function}{ARGS}"

    def _tail(self, body: str) -> list[ToolCall] | None:
        body = body.strip()
        if body.startswith("["):
            try:
                objs = json.loads(body)
            except json.JSONDecodeError:
                return None
            if not isinstance(objs, list):
                return None
            return only_calls(
                [
                    self._call(o.get("name"), o.get("arguments", {})) if isinstance(o, dict) else None
                    for o in objs
                ]
            )
        calls = []
        for part in body.split(START):
            name, sep, args = part.partition(ARGS)
            if not sep:
                return None
            try:
                calls.append(self._call(name.strip(), json.loads(args)))
            except json.JSONDecodeError:
                return None
        return only_calls(calls)

    def _call(self, name: object, args: object) -> ToolCall | None:
        if not isinstance(name, str) or not self.known(name):
            return None
        dumped = dump_arguments(args)
        return None if dumped is None else ToolCall(name, dumped, mistral_call_id())
