"""The device half of logprobs of given tokens (prompt logprobs in generate, and `Engine.score`).

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

import torch

from rollout.state.scheduled import ScheduledBatch

LOGIT_BLOCK_BYTES = 256 << 20


@dataclass
class PromptPiece:
    """Logprobs of tokens first..first+len-1 of one sequence, computed by one prefill chunk."""

    first: int  # index in the sequence's token_ids of the first token scored
    logprobs: list[float]
    top: list[dict[int, float]] | None
    ranks: list[int] | None = None  # with SamplingParams.logprob_ranks: tokens at least as likely


def scored_rows(batch: ScheduledBatch) -> list[tuple[int, int, int, int]]:
    """Per wanted sequence of a prefill batch: (batch index, first hidden row, first position, count).

    Position p's logits score token p + 1; a sequence scores tokens logprobs_from .. num_prompt - 1.
    """
    out, row = [], 0
    for i, (seq, chunk) in enumerate(zip(batch.seqs, batch.chunks)):
        start = seq.num_computed  # the scheduler advances it after the step
        if seq.scoring is not None:
            lo = max(start, seq.scoring.start - 1)
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
    ranked = any(batch.seqs[i].params.logprob_ranks for i, _, _, _ in wanted)
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
    lps, top_lp, top_ids, ranks = [], [], [], []
    block = max(1, LOGIT_BLOCK_BYTES // (4 * vocab_size))
    for a in range(0, len(targets), block):
        logits = model.logits(hidden[rows_t[a : a + block]])
        lp = torch.log_softmax(logits / scale_t[a : a + block].unsqueeze(1), dim=-1)
        chosen = lp.gather(1, target_t[a : a + block].unsqueeze(1))
        lps.append(chosen.squeeze(1))
        if ranked:
            ranks.append((lp >= chosen).sum(dim=1))
        if k:
            v, ix = lp.topk(k, dim=-1)
            top_lp.append(v)
            top_ids.append(ix)
    flat = torch.cat(lps).tolist()  # one copy to the host
    top_v = torch.cat(top_lp).tolist() if k else None
    top_i = torch.cat(top_ids).tolist() if k else None
    rank_l = torch.cat(ranks).tolist() if ranked else None
    pieces, at = {}, 0
    for (i, _, pos, count), want in zip(wanted, tops):
        top = None
        if want:
            top = [dict(zip(top_i[j][:want], top_v[j][:want])) for j in range(at, at + count)]
        rank = rank_l[at : at + count] if rank_l is not None and batch.seqs[i].params.logprob_ranks else None
        pieces[i] = PromptPiece(pos + 1, flat[at : at + count], top, rank)
        at += count
    return pieces
