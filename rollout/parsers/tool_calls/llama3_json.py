"""Llama 3.1/3.2 JSON calls (vLLM's `llama3_json`, SGLang's `llama3`): the output is
`{"name": ..., "parameters": {...}}` (or "arguments"), optionally after `<|python_tag|>`, several
separated by `;`."""

from __future__ import annotations

import json

from rollout.parsers.tool_calls.base import only_calls
from rollout.parsers.tool_calls.prefixed import WholeOutputFormat
from rollout.parsers.types import ToolCall, dump_arguments

TAG = "<|python_tag|>"


class Llama3Json(WholeOutputFormat):
    name = "llama3_json"
    starts = (TAG, "{")

    @classmethod
    def opening(cls, function: str | None) -> str:
        return '{"name": "' if function is None else '{"name": ' + json.dumps(function) + ', "parameters": '

    def calls(self, text: str) -> list[ToolCall] | None:
        text = text.removeprefix(TAG).strip()
        decoder, found, i = json.JSONDecoder(), [], 0
        while i < len(text):
            try:
                obj, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                return None
            found.append(self._call(obj))
            i = end
            while i < len(text) and text[i] in " \n\t;":
                i += 1
            if i < len(text) and text.startswith(TAG, i):
                i += len(TAG)
        return only_calls(found)

    def _call(self, obj: object) -> ToolCall | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not self.known(obj["name"]):
            return None
        args = dump_arguments(obj.get("parameters", obj.get("arguments", {})))
        return None if args is None else ToolCall(obj["name"], args)
