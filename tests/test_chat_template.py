"""rollout.chat without a server: tool and message checks naming the field, and token-exact
continuations (turn k's prompt + its sampled ids + the new messages' ids), also when the model's turn
did not end on the end-of-turn token and when the template renders earlier turns differently later."""

from __future__ import annotations

import pytest

from rollout.chat.template import continuation, first_prompt, prefill
from rollout.chat.tools import Choice, check_tool_choice, check_tools, template_messages
from rollout.models import toy_chat

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return toy_chat.build_tokenizer(tmp_path_factory.mktemp("tok"))


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "tools,field",
    [
        ({"type": "function"}, "tools: must be a list"),
        ([{"type": "retrieval"}], r"tools\[0\]\.type"),
        ([{"type": "function"}], r"tools\[0\]\.function: missing"),
        ([{"type": "function", "function": {"name": "a b"}}], r"tools\[0\]\.function\.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            r"tools\[0\]\.function\.parameters",
        ),
        ([TOOLS[0], TOOLS[0]], r"tools\[1\]\.function\.name: 'get_weather' is offered twice"),
    ],
)
def test_bad_tools_name_the_field(tools, field):
    with pytest.raises(ValueError, match=field):
        check_tools(tools)


def test_tool_choice_and_messages():
    spec = check_tools(TOOLS)
    assert check_tool_choice(None, spec) == Choice(parse=True)
    assert check_tool_choice(None, None) == Choice(parse=False)
    assert check_tool_choice("none", spec) == Choice(parse=False)
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert check_tool_choice(named, spec) == Choice(True, True, "get_weather")
    with pytest.raises(ValueError, match="tool_choice: given without tools"):
        check_tool_choice("required", None)
    with pytest.raises(ValueError, match="tool_choice: required or named calls need"):
        prefill(None, Choice(True, True))
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
    msgs = template_messages(
        USER
        + [
            {"role": "assistant", "tool_calls": [call], "token_ids": [1]},
            {"role": "tool", "tool_call_id": "c1"},
        ]
    )
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "P"} and "token_ids" not in msgs[1]
    bad = dict(call, function={"name": "get_weather", "arguments": "{nope"})
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        template_messages(USER + [{"role": "assistant", "tool_calls": [bad]}])


def _continue(tok, sampled_text, new, first=None):
    first = first or first_prompt(tok, USER, TOOLS, None).token_ids
    sampled = _ids(tok, sampled_text)
    raw = (
        USER
        + [{"role": "assistant", "content": "hello", "reasoning_content": "x", "token_ids": sampled}]
        + new
    )
    return first, sampled, continuation(tok, template_messages(raw), raw, first, TOOLS, None).token_ids


def test_a_continuation_keeps_the_sampled_ids_and_adds_only_the_new_turn(tok):
    new = [{"role": "user", "content": "again"}]
    first, sampled, ids = _continue(tok, "<think>\nx\n</think>\n\nhello<|im_end|>", new)
    tail = "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert ids == first + sampled + _ids(tok, tail)
    # a turn cut by a stop string or max_tokens: the template's end-of-turn marker closes it
    first, sampled, ids = _continue(tok, "<think>\nx\n</think>\n\nhel", new)
    assert ids == first + sampled + _ids(tok, "<|im_end|>" + tail)


def test_a_template_that_drops_earlier_reasoning_still_continues(tok):
    original = tok.chat_template
    tok.chat_template = original.replace(
        "{% if m.reasoning_content %}", "{% if m.reasoning_content and loop.last %}"
    )
    try:
        new = [{"role": "user", "content": "again"}]
        first, sampled, ids = _continue(tok, "<think>\nx\n</think>\n\nhello<|im_end|>", new)
        assert ids == first + sampled + _ids(
            tok, "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
        )
        tok.chat_template = (
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"  # no turn end
        )
        with pytest.raises(ValueError, match="cannot find where the chat template ends an assistant turn"):
            _continue(tok, "hello", new, first=[5, 6])
    finally:
        tok.chat_template = original


def test_continuation_errors_name_the_field(tok):
    raw = USER + [{"role": "assistant", "content": "hi"}]
    with pytest.raises(ValueError, match="prompt_token_ids: needs the last assistant message's token_ids"):
        continuation(tok, template_messages(raw), raw, [1, 2], None, None)
    raw = USER + [
        {"role": "assistant", "content": "a", "token_ids": [7, 7, 7]},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c", "token_ids": [8]},
    ]
    with pytest.raises(ValueError, match=r"messages\[1\]\.token_ids: not in prompt_token_ids"):
        continuation(tok, template_messages(raw), raw, [1, 2], None, None)
    raw[3]["token_ids"] = ["x"]
    with pytest.raises(ValueError, match=r"messages\[3\]\.token_ids: must be a list of token ids"):
        continuation(tok, template_messages(raw), raw, [1, 2], None, None)
