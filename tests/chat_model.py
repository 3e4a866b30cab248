"""The tool-calling chat checkpoint of the server's tool and reasoning tests (rollout/models/toy_chat.py's
tokenizer and Qwen-style template), warmed up on the CPU for a few seconds to answer "weather <f>" with
a known think block and a call to get_weather in format <f>, a broken call, or a call of an unknown
function; and "It is sunny." after a tool result."""

from __future__ import annotations

import hashlib
from pathlib import Path

from rollout.models import toy_chat
from rollout.parsers.tool_calls import Hermes

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
THINK = "<think>\nweather\n</think>\n\n"
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# the cue in the user's message -> what the model learns to answer after its think block
ANSWERS = {
    "h": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "c": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    "</tool_call>",
    "j": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "m": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "p": "[get_weather(city='Paris')]",
    "x": '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}\n</tool_call>',  # broken JSON
    "u": '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # an unknown function
}
PARSER_CUES = {"hermes": "h", "qwen3_coder": "c", "llama3_json": "j", "mistral": "m", "pythonic": "p"}
AFTER_TOOL = "It is sunny."  # what it answers once a tool result came


def examples(tok) -> list[tuple[str, str]]:
    """(prompt, answer) texts: each cue thinking, "h" also without thinking, after the prefilled call
    openings of tool_choice "required" and named "now", and after a tool result."""
    rows = []
    for cue, answer in ANSWERS.items():
        user = [{"role": "user", "content": f"weather {cue}"}]
        for thinking in (True, False) if cue == "h" else (True,):
            prompt = tok.apply_chat_template(
                user, tools=TOOLS, add_generation_prompt=True, tokenize=False, enable_thinking=thinking
            )
            rows.append((prompt, (THINK if thinking else "") + answer + "<|im_end|>"))
        if cue != "h":
            continue
        thinking_prompt = rows[-2][0]
        for name, rest in [(None, answer[len("<tool_call>\n") :]), ("now", "{}}\n</tool_call>")]:
            rows.append((thinking_prompt + Hermes.opening(name), rest + "<|im_end|>"))
        # turn 2 as a token-exact continuation gives it: turn 1 as sampled, then the tool's turn
        call = {"id": "call_1", "type": "function", "function": CALL}
        turn2 = user + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
        full = tok.apply_chat_template(turn2, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        end = full.index("<|im_end|>", full.index("<|im_start|>assistant")) + len("<|im_end|>")
        rows.append((thinking_prompt + rows[-4][1] + full[end:], THINK + AFTER_TOOL + "<|im_end|>"))
    return rows


def build(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tok = toy_chat.build_tokenizer(folder)
    toy_chat.warm_start(folder, examples(tok))


def cached() -> str:
    """The trained checkpoint, built once and kept under $ROLLOUT_CACHE (keyed by this file's and
    toy_chat's text, so an edit retrains)."""
    text = Path(__file__).read_bytes() + Path(toy_chat.__file__).read_bytes()
    return toy_chat.cached("tool-chat", hashlib.sha256(text).hexdigest()[:12], build)
