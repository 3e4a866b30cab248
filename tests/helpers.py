"""Oracles from transformers, used by several test files."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / temperature) of each completion token, as a trainer recomputes it."""
    logits = model(torch.tensor([prompt + completion])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20] * 10, list(range(30, 67)), [3]]
