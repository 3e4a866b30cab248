"""Checks of a chat request's `tools`, `tool_choice` and messages, with errors naming the field, and
the messages made ready for a chat template (tool-call arguments as objects, as templates expect)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolSpec:
    """The offered functions: name -> JSON-schema parameters."""

    schemas: dict[str, dict]

    @property
    def names(self) -> list[str]:
        return list(self.schemas)


def check_tools(tools: list[Any] | None) -> ToolSpec | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError("tools: must be a list of {type: function, function: {name, parameters}}")
    schemas: dict[str, dict] = {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ValueError(f"{where}.type: only 'function' tools are supported")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function: missing or not an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{where}.function.name: must be a non-empty string of letters, digits, _ and -")
        if name in schemas:
            raise ValueError(f"{where}.function.name: {name!r} is offered twice")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters: must be a JSON schema of type object")
        if not isinstance(params.get("properties", {}), dict):
            raise ValueError(f"{where}.function.parameters.properties: must be an object")
        schemas[name] = params
    return ToolSpec(schemas)


@dataclass(frozen=True)
class Choice:
    """What tool_choice asks: parse calls or not, and whether a call (of `function`) must come."""

    parse: bool
    required: bool = False
    function: str | None = None


def check_tool_choice(choice: Any, spec: ToolSpec | None) -> Choice:
    if choice is None:
        return Choice(parse=spec is not None)
    if spec is None:
        if choice == "none":
            return Choice(parse=False)
        raise ValueError("tool_choice: given without tools")
    if choice == "none":
        return Choice(parse=False)
    if choice == "auto":
        return Choice(parse=True)
    if choice == "required":
        return Choice(parse=True, required=True)
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
    ):
        name = choice["function"].get("name")
        if name not in spec.schemas:
            raise ValueError(
                f"tool_choice.function.name: {name!r} is not among tools ({', '.join(spec.names)})"
            )
        return Choice(parse=True, required=True, function=name)
    raise ValueError('tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name"}}')


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a chat template reads them; a tool message must answer an earlier call."""
    out, ids = [], set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}].role: missing")
        m = {k: v for k, v in m.items() if k != "token_ids"}  # ours, not the template's
        if m["role"] == "assistant" and m.get("tool_calls"):
            m["tool_calls"] = [_template_call(i, j, c, ids) for j, c in enumerate(m["tool_calls"])]
        if m["role"] == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or cid not in ids:
                raise ValueError(
                    f"messages[{i}].tool_call_id: {cid!r} answers no tool call of an earlier assistant "
                    "message"
                )
        out.append(m)
    return out


def _template_call(i: int, j: int, call: Any, ids: set[str]) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}.function.name: missing")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):  # OpenAI sends a JSON string; the templates (Qwen, Llama) dump an object
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.function.arguments: not JSON ({e})") from e
    if isinstance(call.get("id"), str):
        ids.add(call["id"])
    return {**call, "function": {**fn, "arguments": args}}
