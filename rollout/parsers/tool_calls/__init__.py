"""Tool-call formats by name."""

from rollout.parsers.tool_calls.base import ToolCallFormat
from rollout.parsers.tool_calls.hermes import Hermes
from rollout.parsers.tool_calls.llama3_json import Llama3Json
from rollout.parsers.tool_calls.mistral import Mistral
from rollout.parsers.tool_calls.pythonic import Pythonic
from rollout.parsers.tool_calls.qwen3_coder import Qwen3Coder

FORMATS: dict[str, type[ToolCallFormat]] = {
    f.name: f for f in (Hermes, Qwen3Coder, Llama3Json, Mistral, Pythonic)
}

__all__ = ["FORMATS", "ToolCallFormat", "Hermes", "Qwen3Coder", "Llama3Json", "Mistral", "Pythonic"]
