"""Stream deltas on the callers' side: joining deltas that queued up, and (for ProcessAsyncEngine)
turning the engine worker's token deltas into RequestOutput deltas with text.

A caller that falls behind the step loop (a busy HTTP loop) gets the deltas that queued up for it as
one, so its per-chunk work (JSON, SSE) shrinks as the load grows instead of lagging further.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from rollout.detok import IncrementalText
from rollout.outputs import CompletionOutput, RequestOutput, TokenDelta


def join(a: CompletionOutput, b: CompletionOutput) -> CompletionOutput:
    """Two consecutive deltas of one sample as one."""
    return CompletionOutput(
        index=a.index,
        token_ids=a.token_ids + b.token_ids,
        text=a.text + b.text,
        logprobs=None if a.logprobs is None else a.logprobs + (b.logprobs or []),
        top_logprobs=None if a.top_logprobs is None else a.top_logprobs + (b.top_logprobs or []),
        finish_reason=b.finish_reason or a.finish_reason,
        stop_reason=b.stop_reason if b.finish_reason else a.stop_reason,
        weight_versions=a.weight_versions + b.weight_versions,
    )


def merge(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one (the last one's facts: finished, prompt logprobs)."""
    if len(outs) == 1:
        return outs[0]
    samples: dict[int, CompletionOutput] = {}
    for out in outs:
        for c in out.outputs:
            prev = samples.get(c.index)
            samples[c.index] = c if prev is None else join(prev, c)
    return replace(outs[-1], outputs=list(samples.values()))


def cut(c: CompletionOutput, tokens: int, chars: int) -> CompletionOutput:
    """A whole output without its first `tokens` tokens and `chars` characters (already streamed)."""
    return replace(
        c,
        token_ids=c.token_ids[tokens:],
        text=c.text[chars:],
        logprobs=None if c.logprobs is None else c.logprobs[tokens:],
        top_logprobs=None if c.top_logprobs is None else c.top_logprobs[tokens:],
        weight_versions=c.weight_versions[tokens:],
    )


@dataclass
class _Sample:
    detok: IncrementalText | None
    tokens: int = 0  # streamed so far
    chars: int = 0


@dataclass(eq=False)
class StreamedText:
    """One streamed request's samples as the parent sees them: token deltas in, RequestOutput deltas
    with text out (the same text results.py's deltas show), then the whole final output cut to what
    was not streamed yet."""

    prompt_token_ids: list[int]
    prompt: str | None
    tokenizer: Any
    skip_special_tokens: bool
    holdback: int = 0  # SamplingParams.stream_holdback
    samples: dict[int, _Sample] = field(default_factory=dict)

    def tokens(self, deltas: list[TokenDelta]) -> RequestOutput:
        """One step's token deltas of this request as one RequestOutput."""
        outputs = [self._completion(d) for d in deltas]
        return RequestOutput(
            self.prompt_token_ids, outputs, self.prompt, deltas[0].request_id, finished=False
        )

    def final(self, out: RequestOutput) -> RequestOutput:
        """The request's whole last output (from the worker) less what was streamed."""
        outputs = []
        for c in out.outputs:
            s = self.samples.get(c.index)
            outputs.append(c if s is None else cut(c, s.tokens, s.chars))
        return replace(out, outputs=outputs, prompt=self.prompt)

    def _completion(self, d: TokenDelta) -> CompletionOutput:
        s = self.samples.get(d.sample)
        if s is None:
            tok = self.tokenizer
            s = self.samples[d.sample] = _Sample(
                None if tok is None else IncrementalText(tok, self.skip_special_tokens)
            )
        text = ""
        if s.detok is not None:
            for t in d.token_ids:
                s.detok.push(t)
            shown = s.detok.text if d.stop_text is None else d.stop_text
            if d.finish_reason is None:
                shown = shown[: max(s.chars, len(shown) - self.holdback)]
            text, s.chars = shown[s.chars :], len(shown)
        elif d.stop_text is not None:
            text, s.chars = d.stop_text[s.chars :], len(d.stop_text)
        s.tokens += len(d.token_ids)
        return CompletionOutput(
            index=d.sample,
            token_ids=d.token_ids,
            text=text,
            logprobs=d.logprobs,
            top_logprobs=d.top_logprobs,
            finish_reason=d.finish_reason,
            stop_reason=d.stop_reason,
            weight_versions=d.weight_versions,
        )
