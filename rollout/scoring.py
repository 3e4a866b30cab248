"""Logprobs of given tokens: prompt logprobs in generate, and `Engine.score` (no sampling at all).

A sequence that wants them carries `logprobs_from` (the index of its first token to score). Its prefill
chunks then go through the same paged KV cache and scheduler as any prompt; the runner takes the
hidden state at every position of the chunk whose next token is scored, and computes
log_softmax(logits / temperature) at that next token in row blocks, so a 150k vocabulary never needs
more than LOGIT_BLOCK_BYTES of float32 logits at once. The prefix cache may hand a sequence pages only
before `logprobs_from - 1` (the scheduler trims the match): positions whose logits are wanted are
always computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rollout.scheduler import ScheduledBatch

LOGIT_BLOCK_BYTES = 256 << 20


@dataclass
class PromptPiece:
    """Logprobs of tokens first..first+len-1 of one sequence, computed by one prefill chunk."""

    first: int  # index in the sequence's token_ids of the first token scored
    logprobs: list[float]
    top: list[dict[int, float]] | None


@dataclass
class ScoreOutput:
    """`Engine.score`'s answer for one sequence: logprobs[j] is the logprob of token_ids[start + j]."""

    token_ids: list[int]
    start: int
    logprobs: list[float]
    # per scored token, the top_logprobs most likely {token_id: logprob} (None when top_logprobs == 0)
    top_logprobs: list[dict[int, float]] | None = None
    # MoE models on an engine with enable_return_routed_experts: int32 [len(token_ids) - 1, MoE layers,
    # top_k], the experts this scoring forward chose (the old-logprob pass's routes, for replay)
    routed_experts: Any = None


def scored_rows(batch: ScheduledBatch) -> list[tuple[int, int, int, int]]:
    """Per wanted sequence of a prefill batch: (batch index, first hidden row, first position, count).

    Position p's logits score token p + 1; a sequence scores tokens logprobs_from .. num_prompt - 1.
    """
    out, row = [], 0
    for i, (seq, chunk) in enumerate(zip(batch.seqs, batch.chunks)):
        start = seq.num_computed  # the scheduler advances it after the step
        if seq.logprobs_from is not None:
            lo = max(start, seq.logprobs_from - 1)
            hi = min(start + chunk, seq.num_prompt - 1)
            if hi > lo:
                out.append((i, row + lo - start, lo, hi - lo))
        row += chunk
    return out


@torch.inference_mode()
def prompt_logprobs(
    model: torch.nn.Module, hidden: torch.Tensor, batch: ScheduledBatch, vocab_size: int
) -> dict[int, PromptPiece] | None:
    """The pieces a prefill batch computed, by batch index; None when no sequence wants any."""
    if batch.decode:
        return None
    wanted = scored_rows(batch)
    if not wanted:
        return None
    device = hidden.device
    rows, targets, scales, tops = [], [], [], []
    for i, row, pos, count in wanted:
        seq = batch.seqs[i]
        rows.append(torch.arange(row, row + count))
        targets += seq.token_ids[pos + 1 : pos + 1 + count]
        t = seq.params.temperature
        scales += [t if t > 0 else 1.0] * count
        tops.append(seq.params.prompt_logprobs or 0)
    rows_t = torch.cat(rows).to(device)
    target_t = torch.tensor(targets, dtype=torch.int64, device=device)
    scale_t = torch.tensor(scales, dtype=torch.float32, device=device)
    k = max(tops)
    lps, top_lp, top_ids = [], [], []
    block = max(1, LOGIT_BLOCK_BYTES // (4 * vocab_size))
    for a in range(0, len(targets), block):
        logits = model.logits(hidden[rows_t[a : a + block]])
        lp = torch.log_softmax(logits / scale_t[a : a + block].unsqueeze(1), dim=-1)
        lps.append(lp.gather(1, target_t[a : a + block].unsqueeze(1)).squeeze(1))
        if k:
            v, ix = lp.topk(k, dim=-1)
            top_lp.append(v)
            top_ids.append(ix)
    flat = torch.cat(lps).tolist()  # one copy to the host
    top_v = torch.cat(top_lp).tolist() if k else None
    top_i = torch.cat(top_ids).tolist() if k else None
    pieces, at = {}, 0
    for (i, _, pos, count), want in zip(wanted, tops):
        top = None
        if want:
            top = [dict(zip(top_i[j][:want], top_v[j][:want])) for j in range(at, at + count)]
        pieces[i] = PromptPiece(pos + 1, flat[at : at + count], top)
        at += count
    return pieces


def check_score_inputs(
    token_lists: list[list[int]],
    start: object,
    top_logprobs: object,
    temperature: object,
    max_model_len: int,
    pool_tokens: int,
) -> list[int]:
    """Each sequence's first scored index (1 <= start < len); the lengths must fit the engine."""
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise ValueError(f"top_logprobs must be an int >= 0, got {top_logprobs!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    n = len(token_lists)
    if start is None:
        starts = [1] * n
    elif isinstance(start, int) and not isinstance(start, bool):
        starts = [start] * n
    elif isinstance(start, (list, tuple)) and all(
        isinstance(s, int) and not isinstance(s, bool) for s in start
    ):
        if len(start) != n:
            raise ValueError(f"start has {len(start)} entries for {n} sequences")
        starts = list(start)
    else:
        raise TypeError(f"start must be an int, a list of ints or None, got {type(start).__name__}")
    for i, (tokens, s) in enumerate(zip(token_lists, starts)):
        if not 1 <= s < len(tokens):
            raise ValueError(
                f"start={s} for sequence {i} of {len(tokens)} tokens: it must be in [1, {len(tokens)})"
            )
        if len(tokens) > min(max_model_len, pool_tokens):
            raise ValueError(
                f"sequence {i}: {len(tokens)} tokens exceed max_model_len={max_model_len} "
                f"or the KV pool of {pool_tokens} tokens"
            )
    return starts


def score_groups(token_lists: list[list[int]], starts: list[int]) -> list[list[int]]:
    """Sequence indices grouped by their unscored prefix (token_ids[:start]), in first-seen order: a
    group is one request, its first member computes the prefix and the others share its pages."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (tokens, s) in enumerate(zip(token_lists, starts)):
        groups.setdefault(tuple(tokens[:s]), []).append(i)
    return list(groups.values())


def score_output(seq, top_logprobs: int) -> ScoreOutput:
    return ScoreOutput(
        token_ids=list(seq.token_ids),
        start=seq.logprobs_from,
        logprobs=list(seq.prompt_logprobs),
        top_logprobs=list(seq.prompt_top_logprobs) if top_logprobs else None,
    )
