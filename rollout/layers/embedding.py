"""Vocabulary-parallel embedding and LM head (rows padded so every TP rank holds an equal slice)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout.distributed import SINGLE, TPGroup
from rollout.layers.linear import empty_param


class VocabEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, *, tp: TPGroup = SINGLE, dtype: torch.dtype, device=None):
        super().__init__()
        self.tp, self.vocab, self.hidden = tp, vocab, hidden
        self.local_vocab = -(-vocab // tp.size)
        self.start = tp.rank * self.local_vocab
        self.weight = empty_param(self.local_vocab, hidden, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)

    def hf_shape(self, param: str, shard: None) -> tuple[int, ...]:
        return (self.vocab, self.hidden)

    def copy_pair(
        self, param: str, shard: None, full: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """None when this rank's rows have padding to zero (load does that)."""
        if self.start + self.local_vocab > self.vocab:
            return None
        return self.weight.data, full.narrow(0, self.start, self.local_vocab)

    def load(self, param: str, shard: None, full: torch.Tensor) -> None:
        n = max(0, min(self.local_vocab, self.vocab - self.start))
        self.weight.data[:n].copy_(full[self.start : self.start + n])
        self.weight.data[n:].zero_()

    def read(self, param: str, shard: None) -> torch.Tensor:
        return self.tp.all_gather(self.weight.data, dim=0)[: self.vocab]


class LMHead(VocabEmbedding):
    """Projects hidden states to logits over the full vocabulary (gathered across TP ranks)."""

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(F.linear(h, self.weight), dim=-1)[..., : self.vocab]
