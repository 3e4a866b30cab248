"""Deciding when a sample is finished, and the text it shows."""

from __future__ import annotations

from typing import Any

from rollout.detok import IncrementalText
from rollout.sequence import Sequence


class StopChecker:
    """EOS, stop tokens, stop strings and max_new_tokens, checked after each appended token."""

    def __init__(self, eos_ids: frozenset[int], tokenizer: Any):
        self.eos_ids, self.tokenizer = eos_ids, tokenizer

    def check(self, seq: Sequence) -> bool:
        """Set finish_reason (and the visible text when a stop string ends the sample)."""
        p, token = seq.params, seq.token_ids[-1]
        if not p.ignore_eos and token in self.eos_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif p.stop_token_ids and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif p.stop_strings and self._hit_stop_string(seq):
            seq.finish_reason = "stop"
        elif seq.num_output >= p.max_new_tokens:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _hit_stop_string(self, seq: Sequence) -> bool:
        if seq.detok is None:
            seq.detok = IncrementalText(self.tokenizer, seq.params.skip_special_tokens)
        before = len(seq.detok.text)
        seq.detok.update(seq.output_ids)
        # only the tail that the new text can have completed
        tail_start = max(0, before - max(len(s) for s in seq.params.stop_strings) + 1)
        text = seq.detok.text
        hits = [(i, s) for s in seq.params.stop_strings if (i := text.find(s, tail_start)) >= 0]
        if not hits:
            return False
        # the visible text is cut from the whole decode, as a non-incremental decoder shows it
        full = self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
        in_full = [(i, s) for s in seq.params.stop_strings if (i := full.find(s)) >= 0]
        index, stop = min(in_full or hits)
        seq.text, seq.stop_reason = (full if in_full else text)[:index], stop
        return True
