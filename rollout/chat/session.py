"""A multi-turn chat over an async engine, token-exact: each turn's prompt is the previous turn's prompt,
its sampled ids and the new messages' ids (rollout/chat/template.py), never a re-rendered conversation.

    session = engine.chat_session(tools=TOOLS, tool_parser="hermes", reasoning_parser="qwen3")
    turn = await session.send([{"role": "user", "content": "weather in Paris?"}], params)
    while turn.message.get("tool_calls"):
        calls = turn.message["tool_calls"]
        results = [{"role": "tool", "tool_call_id": c["id"], "content": run(c)} for c in calls]
        turn = await session.send(results, params)
    session.token_ids, session.sampled, session.logprobs   # what the trainer trains on
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout.chat.output import OutputPlan, split_whole
from rollout.chat.template import chat_prompt
from rollout.chat.tools import check_tool_choice, check_tools, template_messages
from rollout.sampling import SamplingParams


@dataclass(frozen=True)
class Turn:
    prompt_ids: list[int]
    token_ids: list[int]  # as sampled
    logprobs: list[float] | None
    text: str
    message: dict[str, Any]  # the assistant message (content, reasoning_content, tool_calls, token_ids)
    finish_reason: str | None


@dataclass
class ChatSession:
    engine: Any  # an AsyncEngine or ProcessAsyncEngine
    tools: list[dict] | None = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the whole conversation so far, as ids
    sampled: list[bool] = field(default_factory=list)  # per id: sampled by the model (train on it)
    logprobs: list[float] = field(default_factory=list)  # per id: the engine's logprob, 0 where not sampled
    prompt_ids: list[int] | None = None  # the last turn's prompt (a continuation starts from it)

    async def send(self, new_messages: list[dict[str, Any]], params: SamplingParams | None = None) -> Turn:
        """Add messages (tool results, a user turn), sample the assistant's answer, append it."""
        params = params or SamplingParams(logprobs=True)
        spec = check_tools(self.tools)
        raw = self.messages + list(new_messages)
        prompt = chat_prompt(
            self.engine.tokenizer,
            raw,
            template_messages(raw),
            self.tools,
            self.chat_template_kwargs,
            self.prompt_ids,
        )
        out = (await self.engine.generate(input_ids=prompt.token_ids, sampling_params=params)).outputs[0]
        plan = OutputPlan(
            self.tool_parser,
            self.reasoning_parser,
            spec,
            check_tool_choice(None, spec),
            True,
            "",
            prompt.thinking_open,
        )
        parsed = split_whole(plan, out.text)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": parsed.content or "",
            "token_ids": out.token_ids,
        }
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        added = prompt.token_ids[len(self.token_ids) :]
        self.prompt_ids = prompt.token_ids
        self.token_ids = prompt.token_ids + out.token_ids
        self.sampled += [False] * len(added) + [True] * len(out.token_ids)
        lps = out.logprobs if out.logprobs is not None else [0.0] * len(out.token_ids)
        self.logprobs += [0.0] * len(added) + list(lps)
        self.messages = raw + [message]
        return Turn(prompt.token_ids, out.token_ids, out.logprobs, out.text, message, out.finish_reason)
