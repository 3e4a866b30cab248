"""/v1/chat/completions with tools and reasoning: the request made into a prompt and an output plan
(rollout/chat), and the engine's outputs made into OpenAI's message and streaming deltas.

- `tools` are rendered by the checkpoint's chat template; the output is parsed by the server's
  --tool-call-parser into `message.tool_calls` (ids `call_...`, arguments JSON strings) with
  finish_reason "tool_calls". Without the flag the output is plain content.
- tool_choice "none" parses nothing; "required" and a named function prefill the parser's call opening
  (`<tool_call>\\n`, or up to the arguments for a named function) into the prompt, so the model writes
  the rest of the call; parallel_tool_calls false keeps the first call.
- --reasoning-parser splits `<think>...</think>` into `reasoning_content`.
- `prompt_token_ids` with `token_ids` on the last assistant message: a token-exact continuation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from rollout.chat.output import OutputPlan, OutputSplitter
from rollout.chat.template import Prompt, chat_prompt, prefill
from rollout.chat.tools import check_tool_choice, check_tools, template_messages
from rollout.outputs import CompletionOutput
from rollout.parsers import reasoning_format, tool_format
from rollout.parsers.types import Content, Piece, Reasoning, ToolCall, gather


@dataclass(frozen=True)
class ChatParsers:
    """The server's --tool-call-parser and --reasoning-parser (None: off)."""

    tool_call: str | None = None
    reasoning: str | None = None

    def __post_init__(self) -> None:  # an unknown name fails at start, listing the known ones
        if self.tool_call is not None:
            tool_format(self.tool_call)
        if self.reasoning is not None:
            reasoning_format(self.reasoning)


def prepare(req: Any, tok: Any, parsers: ChatParsers) -> tuple[Prompt, OutputPlan]:
    spec = check_tools(req.tools)
    choice = check_tool_choice(req.tool_choice, spec)
    messages = template_messages(req.messages)
    opening = prefill(parsers.tool_call, choice)
    prompt = chat_prompt(
        tok, req.messages, messages, req.tools, req.chat_template_kwargs, req.prompt_token_ids, opening
    )
    plan = OutputPlan(
        tool_parser=parsers.tool_call,
        reasoning_parser=parsers.reasoning,
        spec=spec,
        choice=choice,
        parallel=req.parallel_tool_calls,
        prefill=prompt.prefill,
        thinking_open=prompt.thinking_open,
    )
    return prompt, plan


def message(plan: OutputPlan, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a whole output, and its finish_reason. A prefilled opening that the
    model did not turn into a call comes back in the content, with the rest."""
    s = OutputSplitter(plan)
    parsed = gather(s.feed(c.text) + s.finish())
    # content is null beside calls or reasoning (as OpenAI and vLLM send it), else the text, "" included
    content = parsed.content if parsed.tool_calls or parsed.reasoning is not None else parsed.content or ""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if plan.reasoning_parser is not None:
        msg["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        msg["tool_calls"] = [t.to_openai() for t in parsed.tool_calls]
    return msg, _reason(c.finish_reason, bool(parsed.tool_calls))


def _reason(finish: str | None, called: bool) -> str | None:
    return "tool_calls" if called and finish is not None else finish


class DeltaMaker:
    """One sample's streaming deltas: content, reasoning_content and tool_calls (each call whole, in one
    delta, once it parses; indexed from 0 as OpenAI does). White space in the content is kept back
    until text follows: beside a call it is the format's (between `</think>` and `<tool_call>`), and
    the whole-output message drops it too."""

    def __init__(self, plan: OutputPlan):
        self.splitter, self.calls, self.space = OutputSplitter(plan), 0, ""

    def delta(self, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        pieces = self.splitter.feed(c.text)
        if c.finish_reason is not None:
            pieces += self.splitter.finish()
        delta = self._delta(pieces)
        if c.finish_reason is not None and self.space and not self.calls:
            delta["content"] = delta.get("content", "") + self.space
        return delta, _reason(c.finish_reason, self.calls > 0)

    def _delta(self, pieces: list[Piece]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        for p in pieces:
            if isinstance(p, Content):
                if not p.text.strip():
                    self.space += p.text
                    continue
                delta["content"] = delta.get("content", "") + self.space + p.text
                self.space = ""
            elif isinstance(p, Reasoning):
                delta["reasoning_content"] = delta.get("reasoning_content", "") + p.text
            elif isinstance(p, ToolCall):
                delta.setdefault("tool_calls", []).append({"index": self.calls, **p.to_openai()})
                self.space = ""
                self.calls += 1
        return delta


async def deltas(plan: OutputPlan, outs: AsyncIterator[Any]) -> AsyncIterator[tuple[Any, list[tuple]]]:
    """Per engine chunk: the chunk and, per sample, (sample, delta, finish_reason)."""
    makers: dict[int, DeltaMaker] = {}
    async for out in outs:
        rows = []
        for c in out.outputs:
            maker = makers.setdefault(c.index, DeltaMaker(plan))
            delta, reason = maker.delta(c)
            rows.append((c, delta, reason))
        yield out, rows
