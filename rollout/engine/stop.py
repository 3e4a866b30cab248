"""Deciding when a sample is finished, and the text it shows."""

from __future__ import annotations

from typing import Any

from rollout.engine.detok import IncrementalText
from rollout.state.sequence import Sequence


class StopChecker:
    """EOS, stop tokens, stop strings and max_new_tokens, checked after each appended token."""

    def __init__(self, eos_ids: frozenset[int], tokenizer: Any):
        self.eos_ids, self.tokenizer = eos_ids, tokenizer

    def check(self, seq: Sequence) -> bool:
        """Set finish_reason (and the visible text when a stop string ends the sample)."""
        p, token = seq.params, seq.token_ids[-1]
        if seq.num_output < p.min_tokens:
            # the sampler masks EOS and stop tokens until then; a stop string completed now is skipped
            # (the detokenizer still advances, so a later check looks only at newer text)
            if p.stop_strings:
                self._detok(seq).update(seq.output_ids)
            return False
        if not p.ignore_eos and token in self.eos_ids:
            seq.finish_reason, seq.stop.reason = "stop", token
        elif p.stop_token_ids and token in p.stop_token_ids:
            seq.finish_reason, seq.stop.reason = "stop", token
        elif p.stop_strings and self._hit_stop_string(seq):
            seq.finish_reason = "stop"
        elif seq.num_output >= p.max_new_tokens:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _detok(self, seq: Sequence) -> IncrementalText:
        if seq.stop.detok is None:
            seq.stop.detok = IncrementalText(self.tokenizer, seq.params.skip_special_tokens)
        return seq.stop.detok

    def _hit_stop_string(self, seq: Sequence) -> bool:
        before = len(self._detok(seq).text)
        seq.stop.detok.update(seq.output_ids)
        # only the tail that the new text can have completed
        tail_start = max(0, before - max(len(s) for s in seq.params.stop_strings) + 1)
        text = seq.stop.detok.text
        hits = [(i, s) for s in seq.params.stop_strings if (i := text.find(s, tail_start)) >= 0]
        if not hits:
            return False
        # the visible text is cut from the whole decode, as a non-incremental decoder shows it
        full = self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
        # with min_tokens, a stop string from before it was reached does not count
        start = tail_start if seq.params.min_tokens else 0
        in_full = [(i, s) for s in seq.params.stop_strings if (i := full.find(s, start)) >= 0]
        index, stop = min(in_full or hits)
        end = index + len(stop) if seq.params.include_stop_str_in_output else index
        seq.stop.text, seq.stop.reason = (full if in_full else text)[:end], stop
        return True
