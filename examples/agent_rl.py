"""Agentic RL over HTTP: multi-turn tool-use episodes through `python -m rollout.serve` with the openai
client, token in and token out, trained with GRPO on exactly the sampled tokens and the engine's logprobs.

The task: the user asks where the sun is; the model calls get_weather(city) (a real tool call, parsed
by the server's hermes parser into `message.tool_calls`); the tool answers "sunny" for Paris and "rain"
for Rome and Oslo; the tool's answer goes back as a `role: "tool"` message and the model answers. The
reward is 1 when the tool said "sunny". The model starts from a short supervised warm start
(rollout/models/toy_chat.py) that calls get_weather with one of the three cities at random, so GRPO has a
choice to learn: the probability of Paris rises over the steps.

Each episode continues token-exactly: turn k+1 sends `prompt_token_ids` (turn k's prompt, as
`return_token_ids` gave it) and the assistant message's `token_ids`, so the server never re-tokenizes
earlier turns. The trainer's row is the last prompt + the last sampled ids: loss mask 1 on every id the
model sampled (all turns), 0 on the prompt and the tool's turns, and the logprobs the engine returned.
GRPO (integrations.rl) updates a transformers copy of the policy; its weights go to the server through
/update_weights_from_tensor.

    python3 examples/agent_rl.py                       # warm start, serve, train: a few minutes on a CPU
    python3 examples/agent_rl.py --url http://127.0.0.1:30000 --model PATH   # a server already serving PATH
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import inspect
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from integrations.rl import RolloutBatch, clipped_policy_loss, group_advantages, logprob_gap, policy_logprobs
from rollout.models import toy_chat

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CITIES = ["Paris", "Rome", "Oslo"]
SUNNY = "Paris"
QUESTION = [{"role": "user", "content": "where is the sun?"}]
MAX_TURNS = 3


def call_text(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


def run_tool(name: str, arguments: str) -> str:
    try:
        city = json.loads(arguments).get("city")
    except (ValueError, AttributeError):
        return "error: arguments"
    return ("sunny" if city == SUNNY else "rain") if name == "get_weather" else f"error: no tool {name}"


# -- the warm-started model -----------------------------------------------------------------------
def warm_rows(tok) -> list[tuple[str, str]]:
    """Turn 1: a call with each city (so the model learns a third each); turn 2, after the tool's
    answer as a token-exact continuation places it (after turn 1's sampled <|im_end|>): "Done."."""

    def render(messages: list[dict]) -> str:
        return tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)

    prompt, rows = render(QUESTION), []
    for city in CITIES:
        turn1 = call_text(city) + "<|im_end|>"
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": city}},
        }
        result = run_tool("get_weather", json.dumps({"city": city}))
        full = render(
            QUESTION
            + [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": result},
            ]
        )
        end = full.index("<|im_end|>", full.index("<|im_start|>assistant")) + len("<|im_end|>")
        rows += [(prompt, turn1), (prompt + turn1 + full[end:], "Done.<|im_end|>")]
    return rows


def build_model(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tok = toy_chat.build_tokenizer(folder)
    toy_chat.warm_start(folder, warm_rows(tok), steps=300, exact=False, lr=5e-3)


def warm_model() -> str:
    """Built once, kept under $ROLLOUT_CACHE; keyed by what makes it (not by the rest of this file)."""
    made_of = [inspect.getsource(f) for f in (warm_rows, build_model, call_text, run_tool)]
    made_of += [json.dumps([TOOLS, CITIES, QUESTION]), Path(toy_chat.__file__).read_text()]
    key = hashlib.sha256("\n".join(made_of).encode()).hexdigest()
    return toy_chat.cached("agent-rl", key[:12], build_model)


# -- the server -----------------------------------------------------------------------------------
def start_server(model: str) -> tuple[subprocess.Popen, str]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "rollout.serve", "--model", model, "--port", str(port), "--device", "cpu"]
    cmd += ["--engine-mode", "thread", "--tool-call-parser", "hermes", "--served-model-name", "policy"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError("the server did not start")


def push_weights(url: str, policy: torch.nn.Module) -> None:
    """The policy's weights to the server, as safetensors (no pickle crosses HTTP)."""
    import httpx

    from rollout.serve.tensor_wire import encode_safetensors

    blob = encode_safetensors([(k, v.detach().clone()) for k, v in policy.named_parameters()])
    r = httpx.post(
        url + "/update_weights_from_tensor", json={"serialized_named_tensors": [blob]}, timeout=120
    )
    if not r.json().get("success"):
        raise RuntimeError(f"update_weights_from_tensor: {r.text}")


# -- episodes -------------------------------------------------------------------------------------
@dataclass
class Episode:
    """One multi-turn episode, as token ids."""

    tokens: list[int] = field(default_factory=list)  # the last prompt + the last sampled ids
    sampled: list[bool] = field(default_factory=list)  # per id: sampled by the policy (trained on)
    logprobs: list[float] = field(default_factory=list)  # per id: the engine's logprob, 0 if not sampled
    results: list[str] = field(default_factory=list)  # the tool's answers
    turns: int = 0
    reward: float = 0.0


async def episode(client, seed: int) -> Episode:
    ep, messages, prompt_ids = Episode(), list(QUESTION), None
    for _ in range(MAX_TURNS):
        extra = {"return_token_ids": True} | ({"prompt_token_ids": prompt_ids} if prompt_ids else {})
        r = await client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=TOOLS,
            temperature=1.0,
            max_tokens=64,
            logprobs=True,
            seed=seed * MAX_TURNS + ep.turns,
            extra_body=extra,
        )
        c, prompt_ids = r.choices[0], r.model_extra["prompt_token_ids"]
        ids = c.model_extra["token_ids"]
        if prompt_ids[: len(ep.tokens)] != ep.tokens:  # what the server promises: earlier turns verbatim
            raise RuntimeError("the server re-tokenized an earlier turn")
        new = prompt_ids[len(ep.tokens) :]
        ep.tokens += new + ids
        ep.sampled += [False] * len(new) + [True] * len(ids)
        ep.logprobs += [0.0] * len(new) + [e.logprob for e in c.logprobs.content]
        ep.turns += 1
        calls = c.message.tool_calls or []
        message = {"role": "assistant", "content": c.message.content or "", "token_ids": ids}
        if calls:
            message["tool_calls"] = [t.model_dump() for t in calls]
        messages.append(message)
        if c.finish_reason != "tool_calls":
            break
        for t in calls:
            ep.results.append(run_tool(t.function.name, t.function.arguments))
            messages.append({"role": "tool", "tool_call_id": t.id, "content": ep.results[-1]})
    ep.reward = 1.0 if "sunny" in ep.results else 0.0
    return ep


async def collect(url: str, groups: int, n: int, step: int) -> list[Episode]:
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        return list(
            await asyncio.gather(*(episode(client, step * groups * n + i) for i in range(groups * n)))
        )


# -- training -------------------------------------------------------------------------------------
def to_batch(episodes: list[Episode], n: int, pad_id: int = 0) -> RolloutBatch:
    T, B = max(len(e.tokens) for e in episodes), len(episodes)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn, mask, old = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T), torch.zeros(B, T)
    for i, e in enumerate(episodes):
        L = len(e.tokens)
        ids[i, :L] = torch.tensor(e.tokens)
        attn[i, :L] = 1
        mask[i, :L] = torch.tensor(e.sampled, dtype=torch.float32)
        old[i, :L] = torch.tensor(e.logprobs)
    return RolloutBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=mask,
        old_logprobs=old,
        prompt_lens=torch.tensor([e.sampled.index(True) for e in episodes]),
        completion_lens=mask.sum(1).long(),
        group=torch.arange(B) // n,
    )


def train_step(policy, opt, batch: RolloutBatch, rewards: list[float], n: int) -> tuple[float, float]:
    """One GRPO step; returns the loss and the largest |trainer - engine| logprob before it."""
    adv = group_advantages(torch.tensor(rewards), n)
    logprobs = policy_logprobs(policy, batch)
    gap = logprob_gap(logprobs, batch.old_logprobs, batch.loss_mask)[1]
    loss, _ = clipped_policy_loss(logprobs, batch.old_logprobs, adv, batch.loss_mask)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()
    return loss.item(), gap


def city_probs(policy, tok) -> dict[str, float]:
    """The policy's probability of each city's first letter where its call names the city."""
    prompt = tok.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    head = call_text("@").split("@")[0]
    ids = tok.encode(prompt + head, add_special_tokens=False)
    with torch.no_grad():
        p = torch.softmax(policy(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
    return {c: p[tok.convert_tokens_to_ids(c[0])].item() for c in CITIES}


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = parse_args(argv)
    torch.manual_seed(cfg.seed)
    model = cfg.model or warm_model()
    proc, url = (None, cfg.url) if cfg.url else start_server(model)
    tok = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    report: dict = {"rewards": [], "gaps": [], "paris": [city_probs(policy, tok)[SUNNY]], "episodes": []}
    try:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            episodes = asyncio.run(collect(url, cfg.groups, cfg.n, step))
            rewards = [e.reward for e in episodes]
            loss, gap = train_step(policy, opt, to_batch(episodes, cfg.n), rewards, cfg.n)
            push_weights(url, policy)
            mean = sum(rewards) / len(rewards)
            report["rewards"].append(mean)
            report["gaps"].append(gap)
            report["paris"].append(city_probs(policy, tok)[SUNNY])
            report["episodes"].append(episodes)
            turns = sum(e.turns for e in episodes) / len(episodes)
            print(
                f"step {step:3d}  reward {mean:.3f}  p(Paris) {report['paris'][-1]:.3f}  loss {loss:+.4f}  "
                f"turns/episode {turns:.1f}  max |trainer-engine| logprob {gap:.1e}  "
                f"{time.perf_counter() - t0:.1f}s",
                flush=True,
            )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a tool-calling checkpoint (default: the warm-started toy)")
    ap.add_argument("--url", default=None, help="a server already serving --model (else one is started)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--groups", type=int, default=2, help="GRPO groups per step (all ask the same question)")
    ap.add_argument("--n", type=int, default=8, help="episodes per group")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


if __name__ == "__main__":
    main()
