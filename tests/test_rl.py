"""Trainer-side RL helpers against hand-computed cases, and the trainer/engine logprob convention."""

from __future__ import annotations

import math

import pytest
import torch

from integrations.rl import (
    check_groups,
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    group_advantages,
    logprob_gap,
    masked_whiten,
    policy_logprobs,
    refresh_engine,
    rollout_batch,
    terminal_rewards,
    token_logprobs,
)
from rollout import CompletionOutput, Engine, RequestOutput, SamplingParams


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> bool:
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)
    return True


def completion(index, tokens, logprobs):
    return CompletionOutput(index, tokens, "", logprobs, None, "length")


def two_by_two() -> list[RequestOutput]:
    return [
        RequestOutput([5, 6], [completion(0, [7], [-0.5]), completion(1, [8, 9, 2], [-1.0, -2.0, -3.0])]),
        RequestOutput([4], [completion(0, [3, 3], [-0.25, -0.75]), completion(1, [2], [-4.0])]),
    ]


def test_rollout_batch_pads_and_aligns():
    b = rollout_batch(two_by_two(), pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 0, 0], [5, 6, 8, 9, 2], [4, 3, 3, 0, 0], [4, 2, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 0, 0, 0]]
    assert b.old_logprobs.tolist() == [
        [0, 0, -0.5, 0, 0],
        [0, 0, -1.0, -2.0, -3.0],
        [0, -0.25, -0.75, 0, 0],
        [0, -4.0, 0, 0, 0],
    ]
    assert b.prompt_lens.tolist() == [2, 2, 1, 1]
    assert b.completion_lens.tolist() == [1, 3, 2, 1]
    assert b.group.tolist() == [0, 0, 1, 1]
    assert b.num_tokens == 7
    sub = b.rows(torch.tensor([3, 0]))
    assert sub.input_ids.tolist() == [[4, 2, 0, 0, 0], [5, 6, 7, 0, 0]] and sub.group.tolist() == [1, 0]


def test_rollout_batch_rejects_missing_logprobs():
    outs = two_by_two()
    outs[1].outputs[0].logprobs = None
    with pytest.raises(ValueError, match=r"logprobs=True"):
        rollout_batch(outs)
    outs[1].outputs[0].logprobs = [-1.0]
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        rollout_batch(outs)
    with pytest.raises(ValueError, match="no outputs"):
        rollout_batch([])


def test_token_logprobs_by_hand():
    # position 0 predicts token 1: logits [2 ln 3, 0] at temperature 2 -> probs [3/4, 1/4]
    logits = torch.tensor([[[2 * math.log(3), 0.0], [0.0, 0.0]]])
    ids = torch.tensor([[1, 0]])
    assert close(token_logprobs(logits, ids, temperature=2.0), [[0.0, math.log(3 / 4)]])
    # temperature 0 (greedy) means plain log_softmax: [2 ln 3, 0] -> probs [9/10, 1/10]
    assert close(token_logprobs(logits, ids, temperature=0.0), [[0.0, math.log(9 / 10)]])
    ids = torch.tensor([[1, 1]])
    assert close(token_logprobs(logits, ids, temperature=1.0), [[0.0, math.log(1 / 10)]])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, ids, temperature=-1.0)


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 3.0, 1.0])
    assert group_advantages(r, 2).tolist() == pytest.approx([1, -1, 0, 0, 1, -1], abs=1e-5)
    assert group_advantages(r, 2, scale=False).tolist() == pytest.approx([0.5, -0.5, 0, 0, 1, -1])
    # groups of 3: means 0.5 and 1.5; population std of [1, 0, 0.5] is sqrt(1/6)
    adv = group_advantages(r, 3)
    assert adv[:3].tolist() == pytest.approx([0.5 * 6**0.5, -0.5 * 6**0.5, 0.0], abs=1e-5)
    assert adv.view(2, 3).sum(dim=1).tolist() == pytest.approx([0, 0], abs=1e-5)


def test_group_checks_reject_bad_sizes():
    with pytest.raises(ValueError, match=r"must be >= 2"):
        group_advantages(torch.ones(4), 1)
    with pytest.raises(ValueError, match="5 rewards do not split into groups of 2"):
        group_advantages(torch.ones(5), 2)
    with pytest.raises(TypeError, match="group_size"):
        check_groups(4, 2.0)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.ones(2, 2), 2)


def test_terminal_rewards_on_last_completion_token():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0.0]])
    assert terminal_rewards(torch.tensor([2.0, 3.0, 4.0]), mask).tolist() == [
        [0, 0, 2, 0],
        [0, 0, 0, 3],
        [0, 0, 0, 0],
    ]


def test_gae_by_hand():
    mask = torch.tensor([[0, 1, 1, 1, 0.0]])
    rewards = torch.tensor([[0, 0, 0, 1.0, 0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7, 9.0]])  # 9s are off the mask and must not leak in
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # t=3: 1 - .7 = .3; t=2: .7 - .6 + .5 * .3 = .25; t=1: .6 - .5 + .5 * .25 = .225
    assert close(adv, [[0, 0.225, 0.25, 0.3, 0]])
    assert close(ret, [[0, 0.725, 0.85, 1.0, 0]])
    # lam = 1: returns are the Monte-Carlo return; gamma discounts it
    _, ret = gae(rewards, values, mask, gamma=0.5, lam=1.0)
    assert close(ret, [[0, 0.25, 0.5, 1.0, 0]])


def test_clipped_policy_loss_by_hand():
    old = torch.zeros(1, 3)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    lp = torch.full((1, 3), math.log(1.5), requires_grad=True)
    # ratio 1.5: with a positive advantage the clipped 1.2 counts; with a negative one the unclipped 1.5
    loss, stats = clipped_policy_loss(lp, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.2) and stats.clip_fraction == 1.0
    assert stats.ratio_mean == pytest.approx(1.5)
    loss.backward()
    assert lp.grad.abs().sum().item() == 0  # clipped: no gradient
    lp.grad = None
    loss, stats = clipped_policy_loss(lp, old, torch.tensor([-1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(1.5) and stats.clip_fraction == 0.0
    loss.backward()
    assert close(lp.grad, [[0, 0.75, 0.75]])  # d/dlp of 1.5 * ratio / 2 tokens
    # per-token advantages, a looser upper clip, and padding that would overflow exp()
    lp2 = torch.tensor([[80.0, 0.0, math.log(1.5)]])
    loss, _ = clipped_policy_loss(lp2, old, torch.tensor([[5.0, 2.0, 1.0]]), mask, 0.2, clip_eps_high=0.4)
    assert loss.item() == pytest.approx(-(2.0 + 1.4) / 2)


def test_clipped_value_loss_and_whiten_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    values, old, ret = torch.tensor([[1.0, 0.0, 5.0]]), torch.tensor([[0.0, 0.0, 0.0]]), torch.ones(1, 3)
    # token 0: v moved 1.0 but clipped to 0.2 -> max(0, 0.64); token 1: (0 - 1)^2 = 1
    assert clipped_value_loss(values, old, ret, mask, clip=0.2).item() == pytest.approx(0.5 * (0.64 + 1) / 2)
    w = masked_whiten(torch.tensor([[1.0, 3.0, 100.0]]), mask)
    assert close(w, [[-1, 1, 0]], atol=1e-5)


def test_logprob_gap():
    mask = torch.tensor([[0, 1, 1.0]])
    assert logprob_gap(torch.tensor([[5.0, -1.0, -2.5]]), torch.tensor([[0, -1.5, -2.0]]), mask) == (0.5, 0.5)
    assert logprob_gap(torch.zeros(1, 3), torch.ones(1, 3), torch.zeros(1, 3)) == (0.0, 0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_trainer_recomputes_engine_logprobs(qwen3_dir, hf_models, temperature):
    """The engine's sampled-token logprobs equal the trainer's log_softmax(logits / T), top-k or not."""
    engine = Engine(qwen3_dir, max_total_tokens=2048, seed=0)
    params = SamplingParams(n=3, temperature=temperature, top_k=20, max_new_tokens=12, logprobs=True)
    outs = engine.generate(input_ids=[[5, 6, 7], [11, 12, 13, 14, 15]], sampling_params=params)
    batch = rollout_batch(outs)
    with torch.no_grad():
        trainer = policy_logprobs(hf_models["qwen3"], batch, temperature)
    mean, worst = logprob_gap(trainer, batch.old_logprobs, batch.loss_mask)
    assert worst < 1e-4, (mean, worst)


def test_release_then_refresh_engine_takes_the_policy(qwen3_dir):
    """The loop's engine side on a CPU: release (weights discarded), refresh (staged resume + sync), and
    the engine samples from the trainer's new weights (its prefix cache dropped)."""
    from transformers import AutoModelForCausalLM

    from integrations.metrics import PhaseTimer

    engine = Engine(qwen3_dir, max_total_tokens=2048, seed=0)
    original = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    params = SamplingParams(n=2, max_new_tokens=6, logprobs=True, seed=1)
    prompt = [list(range(3, 40))]  # fills two prefix-cache pages, which must not survive the update
    engine.generate(input_ids=prompt, sampling_params=params)
    engine.release_memory_occupation()
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(input_ids=prompt, sampling_params=params)
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(0.9).add_(0.01)
    timer = PhaseTimer("cpu")
    stats = refresh_engine(policy, engine, timer)
    assert set(timer.seconds) == {"resume", "sync"} and stats.tensors == len(list(policy.parameters()))
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(engine.get_weights_by_name(name), policy.get_parameter(name).detach())
    after = rollout_batch(engine.generate(input_ids=prompt, sampling_params=params))
    with torch.no_grad():
        new, old = policy_logprobs(policy, after), policy_logprobs(original, after)
    assert logprob_gap(new, after.old_logprobs, after.loss_mask)[1] < 1e-4
    assert logprob_gap(old, after.old_logprobs, after.loss_mask)[0] > 1e-2
