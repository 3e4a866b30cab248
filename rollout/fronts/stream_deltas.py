"""Stream deltas on the callers' side: joining deltas that queued up, and (for ProcessAsyncEngine)
turning the engine worker's token deltas into RequestOutput deltas with text.

A caller that falls behind the step loop (a busy HTTP loop) gets the deltas that queued up for it as
one, so its per-chunk work (JSON, SSE) shrinks as the load grows instead of lagging further.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from rollout.engine.detok import IncrementalText
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
        logprob_ranks=None if a.logprob_ranks is None else a.logprob_ranks + (b.logprob_ranks or []),
        # routes come whole, with a sample's last delta
        routed_experts=b.routed_experts if b.routed_experts is not None else a.routed_experts,
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
        logprob_ranks=None if c.logprob_ranks is None else c.logprob_ranks[tokens:],
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
        """Token deltas of this request (one step's, or several steps' that queued up) as one
        RequestOutput: one CompletionOutput per sample, its text decoded once for all its tokens."""
        by_sample: dict[int, list[TokenDelta]] = {}
        for d in deltas:
            by_sample.setdefault(d.sample, []).append(d)
        outputs = [self._completion(ds) for ds in by_sample.values()]
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

    def _completion(self, ds: list[TokenDelta]) -> CompletionOutput:
        """One sample's consecutive token deltas as one delta with its text. The text shown is cut
        once, after all the tokens: text only grows, so this is what cutting after each delta and
        joining the pieces gives."""
        last = ds[-1]
        s = self.samples.get(last.sample)
        if s is None:
            tok = self.tokenizer
            s = self.samples[last.sample] = _Sample(
                None if tok is None else IncrementalText(tok, self.skip_special_tokens)
            )
        ids = ds[0].token_ids if len(ds) == 1 else [t for d in ds for t in d.token_ids]
        text = ""
        if s.detok is not None:
            for t in ids:
                s.detok.push(t)
            shown = s.detok.text if last.stop_text is None else last.stop_text
            if last.finish_reason is None:
                shown = shown[: max(s.chars, len(shown) - self.holdback)]
            text, s.chars = shown[s.chars :], len(shown)
        elif last.stop_text is not None:
            text, s.chars = last.stop_text[s.chars :], len(last.stop_text)
        s.tokens += len(ids)
        return CompletionOutput(
            index=last.sample,
            token_ids=ids,
            text=text,
            logprobs=_joined([d.logprobs for d in ds]),
            top_logprobs=_joined([d.top_logprobs for d in ds]),
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            weight_versions=ds[0].weight_versions
            if len(ds) == 1
            else [v for d in ds for v in d.weight_versions],
        )


def _joined(parts: list[list | None]) -> list | None:
    """Per-token lists of consecutive deltas as one (None when not asked for)."""
    if parts[0] is None:
        return None
    return parts[0] if len(parts) == 1 else [x for p in parts for x in (p or [])]
