"""Pythonic calls (Llama 3.2 / Llama 4, vLLM's and SGLang's `pythonic`): the output is a Python list of
calls with keyword arguments of literal values, `[get_weather(city="Paris"), now()]`, optionally between
`<|python_start|>` and `<|python_end|>`."""

from __future__ import annotations

import ast
import json

from rollout.parsers.tool_calls.base import only_calls
from rollout.parsers.tool_calls.prefixed import WholeOutputFormat
from rollout.parsers.types import ToolCall

START, END = "<|python_start|>", "<|python_end|>"


class Pythonic(WholeOutputFormat):
    name = "pythonic"
    starts = (START, "[")

    @classmethod
    def opening(cls, function: str | None) -> str:
        return "[" if function is None else f"[{function}("

    def calls(self, text: str) -> list[ToolCall] | None:
        text = text.removeprefix(START).removesuffix(END).strip()
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError):
            return None
        if not isinstance(tree, ast.List):
            return None
        return only_calls([self._call(node) for node in tree.elts])

    def _call(self, node: ast.AST) -> ToolCall | None:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if not self.known(node.func.id):
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            dumped = json.dumps(args, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError):
            return None
        if len(args) != len(node.keywords):  # **kwargs
            return None
        return ToolCall(node.func.id, dumped)
