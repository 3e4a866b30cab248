"""Qwen3-Coder's XML calls (vLLM's and SGLang's `qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is read by the parameter's JSON-schema type when the request gave one (strings stay strings),
else as JSON when it parses and as a string when not."""

from __future__ import annotations

import json
import re

from rollout.parsers.tool_calls.base import ToolCallFormat, only_calls, tagged_scan
from rollout.parsers.types import Piece, ToolCall

START, END = "<tool_call>", "</tool_call>"
FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


class Qwen3Coder(ToolCallFormat):
    name = "qwen3_coder"

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        return tagged_scan(text, final, START, END, self._block)

    @classmethod
    def opening(cls, function: str | None) -> str:
        head = START + "\n<function="
        return head if function is None else f"{head}{function}>\n"

    def _block(self, body: str) -> list[ToolCall] | None:
        found = list(FUNCTION.finditer(body))
        if not found or FUNCTION.sub("", body).strip():  # stray text inside the block: not a call
            return None
        return only_calls([self._call(m.group(1).strip(), m.group(2)) for m in found])

    def _call(self, name: str, body: str) -> ToolCall | None:
        if not self.known(name):
            return None
        props = (self.schemas.get(name) or {}).get("properties") or {}
        args = {}
        for m in PARAMETER.finditer(body):
            key = m.group(1).strip()
            args[key] = _value(_trim(m.group(2)), (props.get(key) or {}).get("type"))
        return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _trim(raw: str) -> str:
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _value(raw: str, kind: object) -> object:
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kinds & {"string", "str", "text"}:
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
