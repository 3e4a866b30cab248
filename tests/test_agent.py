"""examples/agent_rl.py end to end on the CPU: multi-turn episodes with real tool calls through a
`python -m rollout.serve` process and the openai client, continued token-exactly; the trainer's ids are
the sampled ids, its logprobs equal the engine's (before and after each weight push), and GRPO raises
the probability of the rewarded call."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agent_rl.py"


@pytest.fixture(scope="module")
def agent():
    spec = importlib.util.spec_from_file_location("agent_rl", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["agent_rl"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_agentic_episodes_over_http_train_on_the_sampled_tokens(agent):
    report = agent.main(["--steps", "3", "--groups", "2", "--n", "8", "--lr", "1e-3"])
    episodes = [e for step in report["episodes"] for e in step]
    assert len(episodes) == 48
    called = [e for e in episodes if e.results]
    assert len(called) > len(episodes) // 2 and all(e.turns >= 2 for e in called)  # tool turns happened
    for e in episodes:
        assert len(e.tokens) == len(e.sampled) == len(e.logprobs)
        assert all((lp < 0) == s or (s and lp == 0.0) for lp, s in zip(e.logprobs, e.sampled))
        assert e.reward == (1.0 if "sunny" in e.results else 0.0)
    # the trainer's logprobs of the sampled ids are the engine's, also after each weight push
    assert max(report["gaps"]) < 5e-3, report["gaps"]
    assert report["paris"][-1] > report["paris"][0] + 0.1, report["paris"]  # it learns
