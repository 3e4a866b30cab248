"""Oracles from transformers, and a driver of arrivals, used by several test files."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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


def arrive_one_a_step(engine, requests: list[tuple], every: int = 1) -> tuple[dict, dict, int]:
    """Drive `engine` with `requests` ((request_id, input_ids, params) each) arriving one before every
    `every`-th step, from the first. Returns each request's output, the step that reported it, and the
    prefill steps that also decoded (mixed steps); the engine ends with nothing in flight, pages free."""
    done, ended, mixed, step, todo = {}, {}, 0, 0, list(requests)
    while engine.has_unfinished() or todo:
        if todo and step % every == 0:
            engine.add_request(*todo.pop(0))
        before = engine.stats
        for out in engine.step():
            done[out.request_id], ended[out.request_id] = out, step
        after = engine.stats
        mixed += after.prefill_steps > before.prefill_steps and after.decode_tokens > before.decode_tokens
        step += 1
    assert engine.stats.requests == 0 and engine.stats.pages_free == engine.stats.pages_total
    return done, ended, mixed


def assert_ranks(lp: torch.Tensor, tokens: list[int], ranks: list[int], tol: float = 1e-4) -> None:
    """Each rank is the count of tokens with a logprob >= the token's own, up to `tol` of rounding
    between the engine's kernels and transformers' (a near-tie may fall either way)."""
    chosen = lp.gather(1, torch.tensor(tokens).unsqueeze(1))
    low = (lp > chosen + tol).sum(1) + 1
    high = (lp >= chosen - tol).sum(1)
    for r, lo, hi in zip(ranks, low.tolist(), high.tolist()):
        assert lo <= r <= hi, (ranks, low.tolist(), high.tolist())


def resolve_ties(logits: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """transformers' router top-k `ids` [T, k], except where the k-th and the next probability are
    exactly equal (a zero hidden state, e.g. the padding token's zero embedding, ties every expert):
    there the k lowest expert ids among the highest, as the engine picks them (layers/topk.py), since
    torch.topk leaves ties to its kernel. Untied rows must equal the top-k of the recorded logits."""
    from rollout.layers.topk import topk_lowest_index_first

    probs = torch.softmax(logits.float(), dim=-1)
    _, lowest = topk_lowest_index_first(probs, k, nonnegative=True)
    if k == probs.shape[-1]:
        return ids
    top = probs.topk(k + 1, dim=-1).values
    tied = top[:, k - 1] == top[:, k]
    assert torch.equal(ids[~tied].sort(-1).values, lowest[~tied].sort(-1).values)
    return torch.where(tied[:, None], lowest, ids)


@contextmanager
def router_top_k(model) -> Iterator[list[torch.Tensor]]:
    """Yields a list receiving, per forward of `model` (transformers, MoE), each token's routed experts
    [T, sparse layers, top_k] int32: transformers' router top-k with exact ties resolved as the engine
    resolves them (`resolve_ties`)."""
    from integrations.routing_replay import moe_gates

    gates = moe_gates(model)
    layers: list[torch.Tensor] = []
    out: list[torch.Tensor] = []

    def hook(module, args, output) -> None:
        logits, _, ids = output
        layers.append(resolve_ties(logits.detach(), ids.detach(), module.top_k))
        if len(layers) == len(gates):
            out.append(torch.stack(layers, dim=1).int())
            layers.clear()

    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()
