"""Reasoning parsers: `<think>...</think>` split into reasoning and content (vLLM's and SGLang's
`qwen3` and `deepseek_r1`).

The white space between `</think>` and the answer is dropped (templates write it back).

- deepseek_r1: the output starts in reasoning (R1's template opens `<think>` in the prompt); a leading
  `<think>` is dropped; reasoning runs to `</think>`, or to the end when it never closes.
- qwen3: the output is reasoning only when it opens with `<think>`, or when the prompt ends in an open
  `<think>` (`started=True`: Qwen3-Thinking templates open it there); with `enable_thinking=False` the
  template closes an empty block in the prompt and all of the output is content.

Deciding at the start, not at the end, is what lets a stream send reasoning as it comes and still say
exactly what the whole-text parse says.
"""

from __future__ import annotations

from rollout.parsers.types import Content, Parsed, Piece, Reasoning, gather, held_prefix

OPEN, CLOSE = "<think>", "</think>"


class ReasoningFormat:
    name = ""
    forced = False  # the output starts in reasoning whatever it opens with

    def __init__(self, started: bool = False):
        self.state = "reasoning" if (started or self.forced) else None  # None: not told yet
        self._skipped_open = False  # a leading <think> is dropped once

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        i = 0
        if self.state in (None, "reasoning") and not self._skipped_open:
            head = text.lstrip()
            if head.startswith(OPEN):
                i = len(text) - len(head) + len(OPEN)
                self.state, self._skipped_open = "reasoning", True
            elif not final and OPEN.startswith(head):
                return [], 0  # "", "<th": could still be the opening
            else:
                self._skipped_open = True
                self.state = self.state or "content"
        if self.state == "after":  # the white space after </think> is the template's (Qwen writes \n\n)
            rest = text[i:].lstrip()
            if not rest:
                return [], len(text)
            i, self.state = len(text) - len(rest), "content"
        if self.state == "content":
            return ([Content(text[i:])] if len(text) > i else []), len(text)
        e = text.find(CLOSE, i)
        if e < 0:
            k = len(text) if final else held_prefix(text, i, CLOSE)
            return ([Reasoning(text[i:k])] if k > i else []), k
        self.state = "after"
        pieces: list[Piece] = [Reasoning(text[i:e])] if e > i else []
        more, used = self.scan(text[e + len(CLOSE) :], final)
        return pieces + more, e + len(CLOSE) + used

    def parse(self, text: str) -> Parsed:
        pieces, _ = self.scan(text, final=True)
        return gather(pieces)


class Qwen3(ReasoningFormat):
    name = "qwen3"


class DeepSeekR1(ReasoningFormat):
    name = "deepseek_r1"
    forced = True


def prompt_opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt ends inside an open <think> (the template started the reasoning)."""
    tail = prompt_text.rstrip()
    return tail.rfind(OPEN) > tail.rfind(CLOSE)
