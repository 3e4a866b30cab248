"""One step's plan, from the scheduler to the runner: which sequences run and how many tokens each
computes."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.state.sequence import Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    chunks: list[int]  # tokens each sequence computes this step
    decode: bool
    decodes: int = 0  # a prefill step's last rows that decode one token each (mixed steps)

    @property
    def num_tokens(self) -> int:
        return sum(self.chunks)

    @property
    def decode_tokens(self) -> int:
        """Tokens of the step that extend an output (the rest compute prompts)."""
        return self.num_tokens if self.decode else self.decodes
