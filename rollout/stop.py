"""Deciding when a sample is finished, and the text it shows."""

from __future__ import annotations

from typing import Any

from rollout.sequence import Sequence


def check_finish(seq: Sequence, eos_ids: frozenset[int], tokenizer: Any) -> bool:
    """Set finish_reason (and the visible text when stop strings are on) after a token was appended."""
    p, token = seq.params, seq.token_ids[-1]
    if not p.ignore_eos and token in eos_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
    elif p.stop_token_ids and token in p.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
    elif p.stop_strings and _hit_stop_string(seq, tokenizer):
        seq.finish_reason = "stop"
    elif seq.num_output >= p.max_new_tokens:
        seq.finish_reason = "length"
    return seq.finish_reason is not None


def _hit_stop_string(seq: Sequence, tokenizer: Any) -> bool:
    text = tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
    # search only the tail that the new token can have completed
    window = max(len(s) for s in seq.params.stop_strings) + 16
    tail_start = max(0, len(seq.text) - window)
    seq.text = text
    hits = [(i, s) for s in seq.params.stop_strings if (i := text.find(s, tail_start)) >= 0]
    if not hits:
        return False
    index, stop = min(hits)
    seq.text, seq.stop_reason = text[:index], stop
    return True
