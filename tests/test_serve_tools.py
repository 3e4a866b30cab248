"""Tools, reasoning and token-exact multi-turn chat through `python -m rollout.serve` with the openai
client, over a tiny checkpoint trained to think and call get_weather (tests/chat_model.py).

One real server process (hermes + qwen3) serves most tests; the other tool-call formats are served by
in-process apps over one engine (a server process each would cost a start-up each)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import chat_model as cm
import httpx
import pytest

pytestmark = pytest.mark.slow

PARIS = {"city": "Paris"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen | None = None) -> None:
    for _ in range(1200):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError(url)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return cm.cached()


@pytest.fixture(scope="module")
def server(model_dir):
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "rollout.serve",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--device",
        "cpu",
    ]
    cmd += ["--engine-mode", "thread", "--max-total-tokens", "8192", "--served-model-name", "tiny"]
    cmd += ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def oc(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def _ask(cue: str, **kw) -> dict:
    return (
        dict(
            model="tiny",
            messages=[{"role": "user", "content": f"weather {cue}"}],
            tools=cm.TOOLS,
            temperature=0,
            max_tokens=120,
        )
        | kw
    )


def _stream(oc, **kw) -> tuple[str, str, list, str, list]:
    """content, reasoning, the tool-call deltas, the finish reason, the chunks."""
    chunks = list(oc.chat.completions.create(stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    return content, reasoning, calls, chunks[-1].choices[0].finish_reason, chunks


def test_a_tool_call_and_its_reasoning_come_back_whole_and_streamed(oc):
    r = oc.chat.completions.create(**_ask("h"))
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None and c.message.reasoning_content == "\nweather\n"
    (call,) = c.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == PARIS

    content, reasoning, calls, reason, chunks = _stream(oc, **_ask("h"))
    assert reasoning == "\nweather\n" and content == "" and reason == "tool_calls"
    (d,) = calls  # the call in one delta, once it parsed, as OpenAI's accumulating clients read it
    assert d.index == 0 and d.id.startswith("call_") and d.function.name == "get_weather"
    assert json.loads(d.function.arguments) == PARIS
    assert chunks[0].choices[0].delta.role == "assistant"


def test_chat_template_kwargs_reach_the_template(oc, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True}
    r = oc.chat.completions.create(**_ask("h"), extra_body=extra)
    c = r.choices[0]
    assert c.message.reasoning_content is None and c.message.tool_calls[0].function.name == "get_weather"
    prompt = tok.decode(r.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the template closed it


def test_completions_take_token_ids_and_return_them_with_each_logprob(oc, model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).encode("weather h", add_special_tokens=False)
    r = oc.completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=6,
        temperature=0,
        logprobs=1,
        extra_body={"return_token_ids": True},
    )
    c = r.choices[0]
    assert c.model_extra["prompt_token_ids"] == ids and len(c.model_extra["token_ids"]) == 6
    assert c.logprobs.model_extra["token_ids"] == c.model_extra["token_ids"]
    assert len(c.logprobs.token_logprobs) == 6


def test_tool_choice_none_auto_required_and_named(oc):
    none = oc.chat.completions.create(**_ask("h", tool_choice="none")).choices[0]
    assert none.message.tool_calls is None and none.finish_reason == "stop"
    assert '<tool_call>\n{"name": "get_weather"' in none.message.content  # the call text, unparsed

    auto = oc.chat.completions.create(**_ask("h", tool_choice="auto")).choices[0]
    assert auto.message.tool_calls[0].function.name == "get_weather"

    # "required": the call's opening is prefilled; the model writes the rest
    req = oc.chat.completions.create(
        **_ask("h", tool_choice="required"), extra_body={"return_token_ids": True}
    )
    c = req.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
    assert c.message.reasoning_content is None  # the prefilled call leaves no room for thinking

    # a named function the model would never call by itself: it comes back, arguments as it wrote them
    named = {"type": "function", "function": {"name": "now"}}
    for stream in (False, True):
        if stream:
            content, _, calls, reason, _ = _stream(oc, **_ask("h", tool_choice=named))
            assert reason == "tool_calls" and content == "" and [t.function.name for t in calls] == ["now"]
        else:
            c = oc.chat.completions.create(**_ask("h", tool_choice=named)).choices[0]
            assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] == [
                "now"
            ]


@pytest.mark.parametrize("cue", ["x", "u"])  # broken JSON; an unknown function
def test_a_malformed_tool_call_is_plain_content(oc, cue):
    c = oc.chat.completions.create(**_ask(cue)).choices[0]
    assert c.message.tool_calls is None and c.finish_reason == "stop"
    want = cm.ANSWERS[cue]
    assert c.message.content == want and c.message.reasoning_content == "\nweather\n"
    content, reasoning, calls, reason, _ = _stream(oc, **_ask(cue))
    assert calls == [] and reason == "stop" and content.strip() == want and reasoning == "\nweather\n"


def test_bad_tools_and_orphan_tool_messages_get_400_naming_the_field(oc):
    import openai

    bad = [{"type": "function", "function": {"name": 3}}]
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.name"):
        oc.chat.completions.create(**_ask("h", tools=bad))
    messages = [
        {"role": "user", "content": "weather h"},
        {"role": "tool", "tool_call_id": "call_nope", "content": "sunny"},
    ]
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]\.tool_call_id"):
        oc.chat.completions.create(**_ask("h", messages=messages))
    with pytest.raises(openai.BadRequestError, match=r"tool_choice\.function\.name"):
        oc.chat.completions.create(**_ask("h", tool_choice={"type": "function", "function": {"name": "x"}}))
    with pytest.raises(openai.BadRequestError, match=r"chat_template_kwargs: chat_template"):
        oc.chat.completions.create(**_ask("h"), extra_body={"chat_template_kwargs": {"chat_template": "x"}})
    with pytest.raises(openai.BadRequestError, match=r"prompt_token_ids"):
        oc.chat.completions.create(**_ask("h"), extra_body={"prompt_token_ids": [1, 2]})
    assert oc.chat.completions.create(**_ask("h")).choices[0].message.tool_calls  # still serving


def test_an_unknown_parser_stops_the_server_at_start(model_dir, capsys):
    cmd = [sys.executable, "-m", "rollout.serve", "--model", model_dir, "--tool-call-parser", "nope"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert (
        "--tool-call-parser: unknown 'nope'; known: hermes, llama3_json, mistral, pythonic, qwen3_coder"
        in r.stderr
    )
    from rollout.serve.__main__ import parse_args  # the same check, without another process start

    with pytest.raises(SystemExit):
        parse_args(["--model", model_dir, "--reasoning-parser", "nope"])
    assert "--reasoning-parser: unknown 'nope'; known: deepseek_r1, qwen3" in capsys.readouterr().err


def test_three_turns_with_tool_results_keep_the_sampled_tokens(oc, model_dir):
    """Turn k+1's prompt is turn k's prompt + its sampled ids + the tool result's ids: the trainer's
    sequence holds exactly the engine's sampled ids, and transformers' logprobs of them equal the
    engine's. Re-rendering the conversation instead would drift (this template drops the reasoning
    of earlier turns and writes tool calls its own way)."""
    _three_turns(oc, model_dir, tol=2e-3)


@pytest.mark.gpu
def test_gpu_server_tool_calls_and_token_exact_turns(model_dir):
    """The same through a server on the GPU (float32; the engine's kernels, CUDA graphs)."""
    import openai

    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "rollout.serve",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--dtype",
        "float32",
    ]
    cmd += ["--served-model-name", "tiny", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    proc = subprocess.Popen(cmd)
    try:
        _wait(f"http://127.0.0.1:{port}", proc)
        oc = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        c = oc.chat.completions.create(**_ask("h")).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.reasoning_content == "\nweather\n"
        assert json.loads(c.message.tool_calls[0].function.arguments) == PARIS
        _three_turns(oc, model_dir, tol=2e-2)
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def _three_turns(oc, model_dir: str, tol: float) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "weather h"}]
    extra = {"return_token_ids": True}
    prompt_ids, seq, sampled, lps, calls = None, [], [], [], []
    for turn in range(3):
        body = {} if prompt_ids is None else {"prompt_token_ids": prompt_ids}
        r = oc.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=cm.TOOLS,
            temperature=1.0,
            seed=turn,
            max_tokens=120,
            logprobs=True,
            extra_body=extra | body,
        )
        c = r.choices[0]
        p, ids = r.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
        assert p[: len(seq)] == seq  # earlier turns kept as sampled, never re-tokenized
        new = p[len(seq) :]
        if turn:  # only the new turn was tokenized: the tool's (or a user's), after the sampled <|im_end|>
            want = "\n<|im_start|>user\n" + ("<tool_response>" if calls else "weather h")
            assert tok.decode(new, skip_special_tokens=False).startswith(want)
        seq, sampled, lps = (
            seq + new + ids,
            sampled + [False] * len(new) + [True] * len(ids),
            lps + [0.0] * len(new) + [e.logprob for e in c.logprobs.content],
        )
        assert [e.token_id for e in c.logprobs.content] == ids
        prompt_ids = p
        msg = {"role": "assistant", "content": c.message.content or "", "token_ids": ids}
        if c.message.reasoning_content:
            msg["reasoning_content"] = c.message.reasoning_content
        calls = c.message.tool_calls or []
        if calls:
            msg["tool_calls"] = [t.model_dump() for t in calls]
        messages = messages + [msg]
        for t in calls:
            messages.append({"role": "tool", "tool_call_id": t.id, "content": f"sunny {turn}"})
        if not calls:
            messages.append({"role": "user", "content": "weather h"})

    rendered = tok.apply_chat_template(
        [{k: v for k, v in m.items() if k != "token_ids"} for m in messages[:-1]],
        tools=cm.TOOLS,
        tokenize=False,
    )
    assert tok.encode(rendered, add_special_tokens=False)[: len(seq)] != seq  # re-rendering would drift

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    at = [i for i, s in enumerate(sampled) if s]
    assert sum(sampled) >= 3 * 10
    assert logp[[i - 1 for i in at]].tolist() == pytest.approx([lps[i] for i in at], abs=tol)


# -- the other formats, over in-process apps sharing one engine ---------------------------------------
@pytest.fixture(scope="module")
def format_urls(model_dir):
    import uvicorn

    from rollout import AsyncEngine
    from rollout.serve import build_app
    from rollout.serve.chat import ChatParsers

    engine = AsyncEngine(model_dir, device="cpu", max_total_tokens=8192)
    servers, urls = [], {}
    for name in ["qwen3_coder", "llama3_json", "mistral", "pythonic"]:
        port = _free_port()
        app = build_app(engine, model_name="tiny", parsers=ChatParsers(name, "qwen3"))
        s = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")
        )
        threading.Thread(target=s.run, daemon=True).start()
        servers.append(s)
        urls[name] = f"http://127.0.0.1:{port}"
    for u in urls.values():
        _wait(u)
    yield urls
    for s in servers:
        s.should_exit = True
    engine.close()


@pytest.mark.parametrize("name", ["qwen3_coder", "llama3_json", "mistral", "pythonic"])
def test_each_tool_call_format_whole_and_streamed(format_urls, name):
    import openai

    oc = openai.OpenAI(base_url=format_urls[name] + "/v1", api_key="none", max_retries=0)
    kw = _ask(cm.PARSER_CUES[name])
    c = oc.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.reasoning_content == "\nweather\n"
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == PARIS
    assert (len(call.id) == 9) if name == "mistral" else call.id.startswith("call_")
    content, reasoning, calls, reason, _ = _stream(oc, **kw)
    assert reason == "tool_calls" and content == "" and reasoning == "\nweather\n"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("get_weather", PARIS)]


def test_a_chat_session_continues_token_exactly(model_dir):
    from rollout import AsyncEngine, SamplingParams

    async def run():
        async with AsyncEngine(model_dir, device="cpu", max_total_tokens=4096) as engine:
            s = engine.chat_session(tools=cm.TOOLS, tool_parser="hermes", reasoning_parser="qwen3")
            params = SamplingParams(temperature=0.0, max_new_tokens=120, logprobs=True)
            t1 = await s.send([{"role": "user", "content": "weather h"}], params)
            (call,) = t1.message["tool_calls"]
            t2 = await s.send([{"role": "tool", "tool_call_id": call["id"], "content": "sunny"}], params)
            return s, t1, t2, engine.tokenizer

    s, t1, t2, tok = asyncio.run(run())
    assert t1.message["reasoning_content"] == "\nweather\n" and t1.finish_reason == "stop"
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.token_ids)] == t1.prompt_ids + t1.token_ids
    assert t2.message["content"] == cm.AFTER_TOOL and "tool_calls" not in t2.message
    assert s.token_ids == t2.prompt_ids + t2.token_ids
    assert [t for t, m in zip(s.token_ids, s.sampled) if m] == t1.token_ids + t2.token_ids
    assert [lp < 0 or not m for lp, m in zip(s.logprobs, s.sampled)] == [True] * len(s.sampled)
