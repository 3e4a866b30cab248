"""Requests to RequestOutputs: whole outputs when a request finishes, deltas for streamed requests; and
TokenDeltas, the text-free deltas a caller reads at its own pace."""

from __future__ import annotations

from typing import Any

import torch

from rollout.engine.detok import IncrementalText
from rollout.outputs import CompletionOutput, RequestOutput, TokenDelta
from rollout.state.sequence import Request, Sequence


def request_output(req: Request, tokenizer: Any) -> RequestOutput:
    """The output `step` reports for a request that gained tokens: a delta when streamed, else whole."""
    make = _delta if req.stream else _whole
    return RequestOutput(
        prompt_token_ids=list(req.prompt_ids),
        outputs=[make(seq, tokenizer) for seq in req.seqs],
        prompt=req.prompt,
        request_id=req.request_id,
        finished=req.finished,
        **_prompt_logprobs(req),
    )


def _prompt_logprobs(req: Request) -> dict:
    """The prompt's logprobs, computed by the first sample's prefill, once it is complete."""
    want, lead = req.params.prompt_logprobs, req.seqs[0]
    if want is None or len(lead.scoring.logprobs) < len(req.prompt_ids) - 1:
        return {}
    return {
        "prompt_logprobs": list(lead.scoring.logprobs),
        "prompt_top_logprobs": list(lead.scoring.top) if want else None,
        "prompt_logprob_ranks": list(lead.scoring.ranks) if req.params.logprob_ranks else None,
    }


def _whole(seq: Sequence, tokenizer: Any) -> CompletionOutput:
    p = seq.params
    return CompletionOutput(
        index=seq.sample,
        token_ids=seq.output_ids,
        text=_final_text(seq, tokenizer),
        logprobs=list(seq.logprobs) if p.logprobs else None,
        top_logprobs=list(seq.top_logprobs) if p.top_logprobs else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop.reason,
        weight_versions=list(seq.weight_versions),
        routed_experts=routed_experts(seq) if p.return_routed_experts else None,
        logprob_ranks=list(seq.logprob_ranks) if p.sample_ranks else None,
    )


def routed_experts(seq: Sequence) -> torch.Tensor | None:
    """The routes of tokens 0 .. num_tokens - 2 (each token the model ran forward; the last one it
    sampled never was), int32 [rows, MoE layers, top_k]; None when none were recorded."""
    if not seq.routes:
        return None
    return torch.cat(seq.routes)[: seq.num_tokens - 1]


def _delta(seq: Sequence, tokenizer: Any) -> CompletionOutput:
    p, start = seq.params, seq.streamed.tokens
    end = seq.num_output
    text = ""
    if tokenizer is not None:
        if seq.stop.detok is None:
            seq.stop.detok = IncrementalText(tokenizer, p.skip_special_tokens)
        seq.stop.detok.update(seq.output_ids)
        if seq.finish_reason:
            shown = _final_text(seq, tokenizer)
        else:
            text = seq.stop.detok.text
            shown = text[: max(seq.streamed.chars, len(text) - p.stream_holdback)]
        text = shown[seq.streamed.chars :]
        seq.streamed.chars = len(shown)
    seq.streamed.tokens = end
    return CompletionOutput(
        index=seq.sample,
        token_ids=seq.token_ids[seq.num_prompt + start : seq.num_prompt + end],
        text=text,
        logprobs=seq.logprobs[start:end] if p.logprobs else None,
        top_logprobs=seq.top_logprobs[start:end] if p.top_logprobs else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop.reason,
        weight_versions=seq.weight_versions[start:end],
        # a stream's routes come whole with its last delta (they are read when its pages are freed)
        routed_experts=routed_experts(seq) if p.return_routed_experts and seq.finish_reason else None,
        logprob_ranks=seq.logprob_ranks[start:end] if p.sample_ranks else None,
    )


def _final_text(seq: Sequence, tokenizer: Any) -> str:
    if isinstance(seq.stop.reason, str):  # a stop string already cut the text
        return seq.stop.text
    if tokenizer is None:
        return ""
    return tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)


def token_deltas(req: Request, sent: list[int]) -> list[TokenDelta]:
    """The tokens each sample of `req` gained past `sent[sample]` output tokens, with no text."""
    deltas = []
    for seq in req.seqs:
        # with overlap_schedule the last token may be a placeholder of the step in flight: not yet
        start, end = sent[seq.sample], seq.num_output - seq.pending
        if end <= start:
            continue
        p, at = seq.params, seq.num_prompt
        deltas.append(
            TokenDelta(
                req.request_id,
                seq.sample,
                seq.token_ids[at + start : at + end],
                seq.logprobs[start:end] if p.logprobs else None,
                seq.top_logprobs[start:end] if p.top_logprobs else None,
                seq.weight_versions[start:end],
                seq.finish_reason,
                seq.stop.reason,
                seq.stop.text if isinstance(seq.stop.reason, str) else None,
            )
        )
    return deltas
