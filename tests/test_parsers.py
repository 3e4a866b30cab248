"""rollout.parsers: each tool-call format and reasoning parser on whole texts and on streams split at
every position (the stream must say exactly what the whole-text parse says), broken calls and unknown
functions as plain content, and the registry's errors."""

from __future__ import annotations

import json

import pytest

from rollout.parsers import (
    Content,
    ToolCall,
    parse_chunks,
    reasoning_parser,
    reasoning_parser_names,
    tool_parser,
    tool_parser_names,
)
from rollout.parsers.tool_calls import FORMATS

TOOLS = ["get_weather", "now"]
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
}

# name -> (text, content, [(name, arguments)])
GOOD = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": 2}), ("now", {})],
    ),
    "qwen3_coder": (
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "Sure.",
        [("get_weather", {"city": "42", "days": 3})],  # "42" stays a string: the schema says so
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "now", "parameters": {}}',
        None,
        [("get_weather", {"city": "Paris"}), ("now", {})],
    ),
    "mistral": (
        'Hm [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "now", "arguments": {}}]',
        "Hm",
        [("get_weather", {"city": "Paris"}), ("now", {})],
    ),
    "pythonic": (
        "[get_weather(city='Paris', days=2), now()]",
        None,
        [("get_weather", {"city": "Paris", "days": 2}), ("now", {})],
    ),
}

# name -> texts that must come back whole as content: broken JSON, an unknown function
BAD = {
    "hermes": [
        'a <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> b',
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
    ],
    "qwen3_coder": [
        "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",
        "<tool_call>\nno function here\n</tool_call>",
    ],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": ', '{"name": "rm_rf", "parameters": {}}'],
    "mistral": [
        'x [TOOL_CALLS][{"name": "get_weather", "arguments": ',
        '[TOOL_CALLS][{"name": "rm", "arguments": {}}]',
    ],
    "pythonic": ["[get_weather(city=]", "[rm_rf()]", "[get_weather(open('x'))]"],
}


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def _every_split(text):
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)  # one character a chunk


def test_registry_lists_every_format():
    assert tool_parser_names() == sorted(["hermes", "qwen3_coder", "llama3_json", "mistral", "pythonic"])
    assert reasoning_parser_names() == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match="known: hermes, llama3_json, mistral, pythonic, qwen3_coder"):
        tool_parser("nope")
    with pytest.raises(ValueError, match="known: deepseek_r1, qwen3"):
        reasoning_parser("nope")


@pytest.mark.parametrize("name", sorted(GOOD))
def test_whole_and_streamed_calls_agree_at_every_split(name):
    text, content, calls = GOOD[name]
    whole = tool_parser(name, TOOLS, SCHEMAS).parse(text)
    assert whole.content == content and _calls(whole) == calls
    for c in whole.tool_calls:
        assert c.id.startswith("call_") if name != "mistral" else (len(c.id) == 9 and c.id.isalnum())
    for chunks in _every_split(text):
        got = parse_chunks(tool_parser(name, TOOLS, SCHEMAS), chunks)
        assert (got.content, _calls(got)) == (content, calls), chunks


@pytest.mark.parametrize("name", sorted(BAD))
def test_broken_or_unknown_calls_are_content_streamed_or_not(name):
    for text in BAD[name]:
        assert tool_parser(name, TOOLS, SCHEMAS).parse(text) == type(tool_parser(name).parse(""))(text, [])
        for chunks in _every_split(text):
            got = parse_chunks(tool_parser(name, TOOLS, SCHEMAS), chunks)
            assert got.content == text and got.tool_calls == [], chunks


@pytest.mark.parametrize("name", sorted(GOOD))
def test_plain_text_is_content(name):
    text = "The weather is fine [really] {yes}."
    for chunks in _every_split(text):
        got = parse_chunks(tool_parser(name, TOOLS), chunks)
        assert got.content == text and got.tool_calls == []


def test_a_stream_sends_a_call_only_once_it_parses():
    from rollout.parsers import Stream

    text = GOOD["hermes"][0]
    s = Stream(tool_parser("hermes", TOOLS))
    end = text.index("</tool_call>") + len("</tool_call>")
    seen = [(i, p) for i in range(len(text)) for p in s.feed(text[i])]
    firsts = [i for i, p in seen if isinstance(p, ToolCall)]
    assert firsts[0] == end - 1  # the call's last character completes it, not before
    assert all(isinstance(p, Content) for i, p in seen if i < end - 1)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_prefilled_opening_parses_with_the_rest(name):
    text, _, calls = GOOD[name]
    fmt = FORMATS[name]
    call_text = text[text.index(fmt.opening(None)) :] if fmt.opening(None) in text else text
    assert tool_parser(name, TOOLS, SCHEMAS).parse(call_text).tool_calls  # the opening is where calls start
    named = fmt.opening("now")
    assert named.startswith(fmt.opening(None).rstrip('"'))


REASONING = [
    # (parser, started, text, reasoning, content)
    ("qwen3", False, "<think>\nI should call.\n</think>\n\nDone.", "\nI should call.\n", "Done."),
    ("qwen3", False, "No thinking here.", None, "No thinking here."),
    ("qwen3", True, "still thinking</think>answer", "still thinking", "answer"),
    ("qwen3", False, "<think>a</think>\n\n  \n", "a", None),
    ("qwen3", False, "<think>never closed", "never closed", None),
    ("deepseek_r1", False, "reason</think>answer", "reason", "answer"),
    ("deepseek_r1", False, "<think>reason</think>answer", "reason", "answer"),
    ("deepseek_r1", False, "all reasoning", "all reasoning", None),
]


@pytest.mark.parametrize("name,started,text,reasoning,content", REASONING)
def test_reasoning_whole_and_streamed(name, started, text, reasoning, content):
    whole = reasoning_parser(name, started).parse(text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for chunks in _every_split(text):
        got = parse_chunks(reasoning_parser(name, started), chunks)
        assert (got.reasoning, got.content) == (reasoning, content), chunks


def test_the_chat_splitter_keeps_one_call_without_parallel_calls_and_none_parses_nothing():
    from rollout.chat.output import OutputPlan, OutputSplitter, split_whole
    from rollout.chat.tools import check_tool_choice, check_tools

    spec = check_tools([{"type": "function", "function": {"name": n}} for n in TOOLS])
    text = "<think>hm</think>" + GOOD["hermes"][0]
    both = OutputPlan("hermes", "qwen3", spec, check_tool_choice("auto", spec))
    one = OutputPlan("hermes", "qwen3", spec, check_tool_choice("auto", spec), parallel=False)
    none = OutputPlan("hermes", "qwen3", spec, check_tool_choice("none", spec))
    assert [c.name for c in split_whole(both, text).tool_calls] == ["get_weather", "now"]
    assert [c.name for c in split_whole(one, text).tool_calls] == ["get_weather"]
    got = split_whole(none, text)
    assert got.tool_calls == [] and got.content == GOOD["hermes"][0] and got.reasoning == "hm"
    for i in range(len(text)):  # streamed, split anywhere
        s = OutputSplitter(one)
        pieces = s.feed(text[:i]) + s.feed(text[i:]) + s.finish()
        assert [p.name for p in pieces if isinstance(p, ToolCall)] == ["get_weather"]
