"""Agentic RL through AsyncEngine: multi-turn tool-use rollouts, token in, token out, trained with GRPO.

Each rollout has two turns. Turn 1: the prompt is a task ("digit 7:" style, from integrations.tasks'
"repeat" task) and the model emits one token, its tool call. The "tool" answers with tokens: " ok:" when
the call is a digit, " no:" otherwise. Turn 2: the prompt is turn 1's prompt + its completion tokens +
the tool's tokens (concatenated ids, never re-tokenised text) and the model writes its answer. The reward
is the answer's score (integrations.tasks.answer_score) when the tool call was a digit, else 0.

The rollouts run concurrently, each its own asyncio task submitting to one AsyncEngine; turn 2 finds
turn 1's pages in the prefix cache, and the prefill tokens each turn computed are measured and printed.
The training batch is one row per rollout: the sampled tokens (both turns) have the engine's logprobs
and loss mask 1; the prompt and the tool's tokens have mask 0. GRPO (integrations.rl) updates a
transformers copy of the policy; its weights go to the engine with update_weights_from_tensor.

    python3 examples/agent_rl.py                    # the built-in tiny model on the CPU, ~1 minute
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import torch

from integrations.rl import RolloutBatch, clipped_policy_loss, group_advantages, policy_logprobs
from integrations.tasks import Problem, Task, answer_score
from rollout import AsyncEngine, SamplingParams
from rollout.models.toy import default_model_dir


@dataclass
class Rollout:
    """One multi-turn episode, as token ids."""

    tokens: list[int]  # every token: prompts, completions, tool outputs
    sampled: list[bool]  # per token: sampled by the policy (trained on) or not
    logprobs: list[float]  # per token: the engine's logprob when sampled, else 0
    reward: float = 0.0


async def turn(engine: AsyncEngine, ro: Rollout, params: SamplingParams) -> list[int]:
    """Sample a completion of everything so far; append it (with its logprobs) to the rollout."""
    out = (await engine.generate(input_ids=ro.tokens, sampling_params=params)).outputs[0]
    ro.tokens += out.token_ids
    ro.sampled += [True] * len(out.token_ids)
    ro.logprobs += out.logprobs
    return out.token_ids


def tool(call: list[int], tok) -> list[int]:
    """The tool's reply, as tokens appended to the context (loss mask 0)."""
    ok = len(call) == 1 and tok.decode(call).isdigit()
    return tok.encode(" ok:" if ok else " no:")


# one token a page: the prefix cache keeps every token of the previous turns (prompts here are short)
PAGE_SIZE = 1
INSTRUCTION = ""  # prepended to every task prompt (tokens, like the rest)


def start(problem: Problem, tok) -> Rollout:
    prompt = tok.encode(INSTRUCTION + problem.prompt)
    return Rollout(list(prompt), [False] * len(prompt), [0.0] * len(prompt))


def add_tool_reply(ro: Rollout, call: list[int], tok) -> bool:
    reply = tool(call, tok)
    ro.tokens += reply
    ro.sampled += [False] * len(reply)
    ro.logprobs += [0.0] * len(reply)
    return reply == tok.encode(" ok:")


async def run_turn(
    engine: AsyncEngine, rollouts: list[Rollout], params: list[SamplingParams], stats: list
) -> list:
    """One turn of every rollout, concurrently; records the prompt tokens and what prefill computed."""
    before, prompt_tokens = engine.stats.prefill_tokens, sum(len(r.tokens) for r in rollouts)
    calls = await asyncio.gather(*(turn(engine, r, p) for r, p in zip(rollouts, params)))
    stats.append((prompt_tokens, engine.stats.prefill_tokens - before))
    return calls


async def collect(engine: AsyncEngine, problems: list[Problem], n: int) -> tuple[list[Rollout], list]:
    tok, stats = engine.tokenizer, []
    group = [p for p in problems for _ in range(n)]
    rollouts = [start(p, tok) for p in group]
    p1 = SamplingParams(temperature=1.0, max_new_tokens=1, ignore_eos=True, logprobs=True)
    calls = await run_turn(engine, rollouts, [p1] * len(rollouts), stats)
    ok = [add_tool_reply(r, c, tok) for r, c in zip(rollouts, calls)]
    p2 = [
        SamplingParams(temperature=1.0, max_new_tokens=len(p.answer), ignore_eos=True, logprobs=True)
        for p in group
    ]
    answers = await run_turn(engine, rollouts, p2, stats)
    for r, p, a, good in zip(rollouts, group, answers, ok):
        r.reward = answer_score(tok.decode(a), p.answer) if good else 0.0
    return rollouts, stats


def to_batch(rollouts: list[Rollout], n: int, pad_id: int) -> RolloutBatch:
    T = max(len(r.tokens) for r in rollouts)
    B = len(rollouts)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn, mask, old = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T), torch.zeros(B, T)
    for i, r in enumerate(rollouts):
        L = len(r.tokens)
        ids[i, :L] = torch.tensor(r.tokens)
        attn[i, :L] = 1
        mask[i, :L] = torch.tensor(r.sampled, dtype=torch.float32)
        old[i, :L] = torch.tensor(r.logprobs)
    first = [r.sampled.index(True) for r in rollouts]
    return RolloutBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=mask,
        old_logprobs=old,
        prompt_lens=torch.tensor(first),
        completion_lens=mask.sum(1).long(),
        group=torch.arange(B) // n,
    )


def train_step(policy, opt, batch: RolloutBatch, rewards: list[float], n: int) -> float:
    adv = group_advantages(torch.tensor(rewards), n)
    loss, _ = clipped_policy_loss(policy_logprobs(policy, batch), batch.old_logprobs, adv, batch.loss_mask)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()
    return loss.item()


async def main_async(cfg: argparse.Namespace) -> list[float]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    model = cfg.model or str(default_model_dir())
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    task = Task("repeat", seed=cfg.seed)
    history = []
    async with AsyncEngine(model, device="cpu", page_size=PAGE_SIZE, seed=cfg.seed) as engine:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            rollouts, turns = await collect(engine, task.sample(cfg.batch), cfg.n)
            rewards = [r.reward for r in rollouts]
            loss = train_step(policy, opt, to_batch(rollouts, cfg.n, pad_id=0), rewards, cfg.n)
            with torch.no_grad():
                await engine.update_weights_from_tensor(
                    [(k, v.detach()) for k, v in policy.named_parameters()]
                )
            mean = sum(rewards) / len(rewards)
            history.append(mean)
            print(
                f"step {step:3d}  reward {mean:.3f}  loss {loss:+.4f}  prompt tokens computed/given by turn: "
                + "  ".join(f"{c}/{t}" for t, c in turns)
                + f"  weight_version {engine.weight_version}  "
                f"{time.perf_counter() - t0:.1f}s",
                flush=True,
            )
    return history


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint folder (default: the built-in tiny model)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16, help="problems per step")
    ap.add_argument("--n", type=int, default=8, help="rollouts per problem (the GRPO group)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[float]:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    main()
