"""One sample's text split as it is generated: reasoning first (when a reasoning parser is on), then
the content through the tool-call parser (when the request offered tools and tool_choice is not
"none"). With parallel_tool_calls off, calls after the first are dropped."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.chat.tools import Choice, ToolSpec
from rollout.parsers import Stream, reasoning_parser, tool_parser
from rollout.parsers.types import Content, Parsed, Piece, ToolCall, gather


@dataclass(frozen=True)
class OutputPlan:
    """How a request's outputs are split (the same for each of its samples)."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None
    spec: ToolSpec | None = None
    choice: Choice = Choice(parse=False)
    parallel: bool = True
    prefill: str = ""  # the prompt's tool-call opening: the output continues it
    thinking_open: bool = False


class OutputSplitter:
    def __init__(self, plan: OutputPlan):
        self.plan = plan
        # a prefilled call opening is the answer: the output has no reasoning before it
        think = plan.reasoning_parser is not None and not plan.prefill
        self.reasoning = (
            Stream(reasoning_parser(plan.reasoning_parser, plan.thinking_open)) if think else None
        )
        parse = plan.choice.parse and plan.tool_parser is not None and plan.spec is not None
        self.tools = (
            Stream(tool_parser(plan.tool_parser, plan.spec.names, plan.spec.schemas)) if parse else None
        )
        self.calls = 0
        self.started = False

    def feed(self, text: str) -> list[Piece]:
        if not self.started:  # the prefill opens the call the output goes on with
            self.started = True
            text = self.plan.prefill + text
        pieces = self.reasoning.feed(text) if self.reasoning else [Content(text)]
        return self._tools(pieces, final=False)

    def finish(self) -> list[Piece]:
        pieces = self.feed("") if not self.started else []
        tail = self.reasoning.finish() if self.reasoning else []
        return pieces + self._tools(tail, final=True)

    def _tools(self, pieces: list[Piece], final: bool) -> list[Piece]:
        if self.tools is None:
            return [p for p in pieces if not (isinstance(p, Content) and not p.text)]
        out: list[Piece] = []
        for p in pieces:
            out += self.tools.feed(p.text) if isinstance(p, Content) else [p]
        if final:
            out += self.tools.finish()
        return [p for p in out if self._keep(p)]

    def _keep(self, p: Piece) -> bool:
        if isinstance(p, ToolCall):
            self.calls += 1
            return self.plan.parallel or self.calls == 1
        return not (isinstance(p, Content) and not p.text)


def split_whole(plan: OutputPlan, text: str) -> Parsed:
    s = OutputSplitter(plan)
    return gather(s.feed(text) + s.finish())
