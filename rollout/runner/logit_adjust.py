"""Changes to the logits before temperature, in vLLM's order: masks (min_tokens, bad words, allowed
tokens) and logit_bias, then the repetition, presence and frequency penalties.

Built for a step only when a request in the batch uses one of them (`SamplingParams.adjusts_logits`,
checked once per batch): the default path never reaches this module. A row's change depends on its own
sequence alone, so seeded draws stay independent of the rest of the batch. Token counts are rebuilt
on the device every step from the sequences' token ids (one scatter over the rows that use a penalty):
nothing to keep in step with preemption, recompute or aborts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from rollout.device.staging import Staging, to_device
from rollout.state.sequence import Sequence


@dataclass
class LogitAdjust:
    mask_rows: torch.Tensor  # int64 [M]: (row, token) pairs set to -inf (min_tokens, bad words)
    mask_tokens: torch.Tensor
    allow_rows: torch.Tensor  # int64 [A]: rows limited to allowed tokens
    allow_index: torch.Tensor  # int64 [L]: (index into allow_rows, token) of each allowed token
    allow_tokens: torch.Tensor
    bias_rows: torch.Tensor  # int64 [B]: (row, token, value) added (logit_bias)
    bias_tokens: torch.Tensor
    bias_values: torch.Tensor  # float32 [B]
    pen_rows: torch.Tensor  # int64 [P]: the batch rows that use a penalty
    pen_values: torch.Tensor  # float32 [P, 3]: repetition, presence, frequency
    out_rows: torch.Tensor  # int64 [O]: (index into pen_rows, token) of each output token
    out_tokens: torch.Tensor
    prompt_rows: torch.Tensor  # int64 [Q]: the same for prompt tokens (repetition penalty only)
    prompt_tokens: torch.Tensor

    @classmethod
    def build(
        cls,
        seqs: list[Sequence],
        eos_ids: Iterable[int],
        vocab: int,
        device: torch.device,
        staging: Staging | None = None,
    ) -> LogitAdjust:
        eos = [t for t in eos_ids if t < vocab]
        mask = _pairs((i, _min_tokens_mask(s, eos) + _bad_words_mask(s)) for i, s in enumerate(seqs))
        allow = [i for i, s in enumerate(seqs) if s.params.allowed_token_ids is not None]
        allowed = _pairs((j, seqs[i].params.allowed_token_ids) for j, i in enumerate(allow))
        bias = [(i, t, b) for i, s in enumerate(seqs) for t, b in (s.params.logit_bias or {}).items()]
        pen = [i for i, s in enumerate(seqs) if s.params.needs_penalties]
        values = [[seqs[i].params.repetition_penalty, seqs[i].params.presence_penalty,
                   seqs[i].params.frequency_penalty] for i in pen]  # fmt: skip
        out = _pairs((j, seqs[i].output_ids) for j, i in enumerate(pen))
        prompt = _pairs(
            (j, seqs[i].token_ids[: seqs[i].num_prompt])
            for j, i in enumerate(pen)
            if seqs[i].params.repetition_penalty != 1.0
        )
        arrays = [
            *mask,
            np.array(allow, dtype=np.int64),
            *allowed,
            np.array([b[0] for b in bias], dtype=np.int64),
            np.array([b[1] for b in bias], dtype=np.int64),
            np.array([b[2] for b in bias], dtype=np.float32),
            np.array(pen, dtype=np.int64),
            np.array(values, dtype=np.float32).reshape(len(pen), 3),
            *out,
            *prompt,
        ]
        return cls(*to_device(arrays, device, staging))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The adjusted logits (a new tensor: the raw ones still give the default logprobs)."""
        logits = logits.clone()
        logits[self.mask_rows, self.mask_tokens] = float("-inf")
        if len(self.allow_rows):
            keep = torch.zeros(len(self.allow_rows), logits.shape[1], dtype=torch.bool, device=logits.device)
            keep[self.allow_index, self.allow_tokens] = True
            logits[self.allow_rows] = logits[self.allow_rows].masked_fill(~keep, float("-inf"))
        logits.index_put_((self.bias_rows, self.bias_tokens), self.bias_values, accumulate=True)
        if len(self.pen_rows):
            logits[self.pen_rows] = self._penalise(logits[self.pen_rows])
        return logits

    def _penalise(self, rows: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(rows)
        counts.index_put_((self.out_rows, self.out_tokens), torch.ones_like(self.out_rows, dtype=rows.dtype),
                          accumulate=True)  # fmt: skip
        seen = counts > 0
        seen[self.prompt_rows, self.prompt_tokens] = True
        rep, presence, frequency = (self.pen_values[:, k : k + 1] for k in range(3))
        # HF/vLLM: a seen token's logit moves towards -inf whatever its sign
        rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
        return rows - presence * (counts > 0) - frequency * counts


def _min_tokens_mask(seq: Sequence, eos: list[int]) -> list[int]:
    """The tokens that may not be sampled yet: EOS (unless ignored) and stop_token_ids."""
    p = seq.params
    if seq.num_output >= p.min_tokens:
        return []
    return sorted(set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos)))


def _bad_words_mask(seq: Sequence) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far (vLLM's bad_words,
    matched against the output only)."""
    words = seq.params.bad_words_ids
    if not words:
        return []
    out = seq.output_ids
    return [w[-1] for w in words if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1 :] == w[:-1]]


def _pairs(items: Iterable[tuple[int, list[int]]]) -> list[np.ndarray]:
    """Flat (row, token) arrays of each row's token list."""
    rows, tokens = [], []
    for row, toks in items:
        rows.append(np.full(len(toks), row, dtype=np.int64))
        tokens.append(np.asarray(toks, dtype=np.int64))
    if not rows:
        return [np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)]
    return [np.concatenate(rows), np.concatenate(tokens)]
