"""examples/agent_rl.py's pieces: multi-turn token-in/token-out rollouts through AsyncEngine, the loss mask
without the tool's tokens, and turn 2 reusing turn 1's cached prefix."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from rollout import AsyncEngine

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agent_rl.py"


@pytest.fixture(scope="module")
def agent():
    spec = importlib.util.spec_from_file_location("agent_rl", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["agent_rl"] = module
    spec.loader.exec_module(module)
    return module


def test_rollouts_mask_tool_tokens_and_reuse_the_prefix(agent, qwen3_dir):
    from integrations.tasks import Task

    async def run():
        async with AsyncEngine(qwen3_dir, device="cpu", page_size=agent.PAGE_SIZE) as engine:
            return await agent.collect(engine, Task("repeat", seed=0).sample(3), 2), engine.tokenizer

    (rollouts, turns), tok = asyncio.run(run())
    assert len(rollouts) == 6 and len(turns) == 2
    for r in rollouts:
        prompt = tok.encode(agent.INSTRUCTION)
        assert r.tokens[: len(prompt)] == prompt
        first = r.sampled.index(True)
        call = r.tokens[first : first + 1]
        reply = agent.tool(call, tok)
        assert r.tokens[first + 1 : first + 1 + len(reply)] == reply  # tool tokens appended as ids
        assert r.sampled == [False] * first + [True] + [False] * len(reply) + [True] * (
            len(r.tokens) - first - 1 - len(reply)
        )
        assert all((lp < 0) == s for lp, s in zip(r.logprobs, r.sampled))  # logprobs exactly where sampled
        assert 0.0 <= r.reward <= 1.0
    (given1, _), (given2, computed2) = turns
    new = sum(len(r.tokens) - r.sampled.count(True) + 1 for r in rollouts) - given1  # call + tool tokens
    assert computed2 <= new < given2  # turn 2 computes only its new tokens: turn 1's context is cached
    batch = agent.to_batch(rollouts, 2, pad_id=0)
    assert batch.loss_mask.sum().item() == sum(sum(r.sampled) for r in rollouts)
