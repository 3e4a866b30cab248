"""The FastAPI app: OpenAI completions/chat, SGLang's /generate and control endpoints, over an AsyncEngine
or a ProcessAsyncEngine (the same methods; the step loop in a thread or in a child process).

Every request goes to the one engine (its step loop batches them); the handlers only translate JSON.
Bad input is a 400 naming the field; a full queue is a 503; the server keeps serving after either.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import pickle
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from rollout.fronts.async_front import AsyncFront, QueueFullError
from rollout.fronts.stream_deltas import join
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.process.child import freeze_heap
from rollout.sampling import SamplingParams
from rollout.serve import chat as C
from rollout.serve import protocol as P


def build_app(
    engine: AsyncFront,
    *,
    model_name: str,
    api_key: str | None = None,
    before_shutdown: Callable[[], None] | None = None,
    parsers: C.ChatParsers | None = None,
) -> FastAPI:
    """The app over `engine`; it shuts the engine down when the server stops, after `before_shutdown`
    (run in a thread: the other server processes over the engine stop first). `parsers`: the
    tool-call and reasoning parsers chat completions split their outputs with."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        freeze_heap()  # the server's start-up heap: no full collection walks it under load
        try:
            yield
            if before_shutdown is not None:
                await asyncio.get_running_loop().run_in_executor(None, before_shutdown)
            await engine.shutdown()  # aborts what is still in flight
        finally:
            gc.unfreeze()

    app = FastAPI(lifespan=lifespan, title="rollout")
    app.state.engine = engine
    _errors(app)
    auth = [Depends(_auth(api_key))] if api_key is not None else []  # none: no per-request dependency
    _openai(app, engine, model_name, auth, parsers or C.ChatParsers())
    _sglang(app, engine, model_name, auth)
    return app


# -- errors and auth ------------------------------------------------------------------------------
def _errors(app: FastAPI) -> None:
    def answer(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "code": status}, "message": message}, status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [
            f"{'.'.join(str(x) for x in e['loc'] if x != 'body') or 'body'}: {e['msg']}" for e in exc.errors()
        ]
        return answer(400, "; ".join(parts))

    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    async def bad_value(request: Request, exc: Exception) -> JSONResponse:
        return answer(400, str(exc))

    @app.exception_handler(QueueFullError)
    async def full(request: Request, exc: QueueFullError) -> JSONResponse:
        return answer(503, str(exc))


def _auth(api_key: str) -> Callable[[Request], Awaitable[None]]:
    async def check(request: Request) -> None:
        if request.headers.get("authorization") != f"Bearer {api_key}":
            raise HTTPException(401, "missing or wrong API key (Authorization: Bearer KEY)")

    return check


# -- OpenAI ---------------------------------------------------------------------------------------
def _openai(app: FastAPI, engine: AsyncFront, model_name: str, auth: list, parsers: C.ChatParsers) -> None:
    tok = engine.tokenizer

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "rollout"}
        return {"object": "list", "data": [card | {"max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: P.CompletionRequest) -> Any:
        params = _params(req, req.max_tokens, req.logprobs is not None, req.logprobs or 0)
        prompts = _prompt_list(req.prompt)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return _sse(_stream_completion(engine, prompts, params, rid, model_name, req))
        outs = await _gather(engine, prompts, params, rid)
        choices, usage = [], _usage(outs)
        for i, out in enumerate(outs):
            for c in out.outputs:
                choice = {"index": i * params.n + c.index, "text": c.text, "finish_reason": _reason(c)}
                choice["logprobs"] = _completion_logprobs(tok, c) if req.logprobs is not None else None
                if req.return_token_ids:
                    choice |= {"prompt_token_ids": out.prompt_token_ids, "token_ids": c.token_ids}
                choices.append(choice)
        return _body(rid, "text_completion", model_name, choices, usage)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(req: P.ChatRequest) -> Any:
        prompt, plan = C.prepare(req, tok, parsers)
        ids = prompt.token_ids
        params = _params(
            req, req.max_completion_tokens or req.max_tokens or 128, req.logprobs, req.top_logprobs
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return _sse(_stream_chat(engine, ids, params, rid, model_name, req, plan))
        out = await engine.generate(input_ids=ids, sampling_params=params, request_id=rid)
        choices = []
        for c in out.outputs:
            message, reason = C.message(plan, c)
            choice = {
                "index": c.index,
                "message": message,
                "finish_reason": reason,
                "logprobs": {"content": _chat_logprobs(tok, c)} if req.logprobs else None,
            }
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body = _body(rid, "chat.completion", model_name, choices, _usage([out]))
        if req.return_token_ids:
            body["prompt_token_ids"] = out.prompt_token_ids
        return body


def _params(req: Any, max_tokens: int, logprobs: bool, top: int) -> SamplingParams:
    return SamplingParams(
        n=req.n,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        max_new_tokens=max_tokens,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        logprobs=logprobs,
        top_logprobs=top,
    )


def _prompt_list(prompt: Any) -> list[dict[str, Any]]:
    """One {"prompts": text} or {"input_ids": ids} per prompt."""
    if isinstance(prompt, str):
        return [{"prompts": prompt}]
    if not prompt:
        raise ValueError("prompt: empty")
    if isinstance(prompt[0], int):  # validated as one of the union's lists: one token list, all ints
        return [{"input_ids": prompt}]
    return [{"prompts": p} if isinstance(p, str) else {"input_ids": p} for p in prompt]


async def _gather(
    engine: AsyncFront, prompts: list[dict], params: SamplingParams, rid: str
) -> list[RequestOutput]:
    calls = [
        engine.generate(sampling_params=params, request_id=f"{rid}-{i}", **p) for i, p in enumerate(prompts)
    ]
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)


def _reason(c: CompletionOutput) -> str | None:
    return c.finish_reason


def _usage(outs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _body(rid: str, kind: str, model: str, choices: list, usage: dict | None) -> dict:
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def _piece(tok: Any, t: int) -> str:
    return tok.decode([t]) if tok is not None else str(t)


def _completion_logprobs(tok: Any, c: CompletionOutput) -> dict:
    tops = c.top_logprobs or [{} for _ in c.token_ids]
    return {
        "tokens": [_piece(tok, t) for t in c.token_ids],
        "token_logprobs": list(c.logprobs or []),
        "top_logprobs": [{_piece(tok, t): lp for t, lp in top.items()} for top in tops],
        "text_offset": [],
        "token_ids": list(c.token_ids),  # pieces can repeat or be empty; the ids say which token
    }


def _chat_logprobs(tok: Any, c: CompletionOutput) -> list[dict]:
    tops = c.top_logprobs or [{} for _ in c.token_ids]
    entries = []
    for t, lp, top in zip(c.token_ids, c.logprobs or [], tops):
        alts = [{"token": _piece(tok, a), "token_id": a, "logprob": v, "bytes": None} for a, v in top.items()]
        entries.append(
            {"token": _piece(tok, t), "token_id": t, "logprob": lp, "bytes": None, "top_logprobs": alts}
        )
    return entries


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _stream_completion(
    engine: AsyncFront, prompts: list[dict], params: SamplingParams, rid: str, model: str, req: Any
) -> AsyncIterator[dict]:
    for i, p in enumerate(prompts):  # one prompt after the other: each streams as it is generated
        first = True
        async for out in engine.stream(sampling_params=params, request_id=f"{rid}-{i}", **p):
            choices = []
            for c in out.outputs:
                choice = {"index": i * params.n + c.index, "text": c.text, "finish_reason": _reason(c)}
                choice["logprobs"] = (
                    _completion_logprobs(engine.tokenizer, c) if req.logprobs is not None else None
                )
                if req.return_token_ids:  # the prompt's ids once, in the first chunk, as vLLM does
                    choice["token_ids"] = c.token_ids
                    if first:
                        choice["prompt_token_ids"] = out.prompt_token_ids
                choices.append(choice)
            first = False
            yield _body(rid, "text_completion", model, choices, None)


async def _stream_chat(
    engine: AsyncFront,
    ids: list[int],
    params: SamplingParams,
    rid: str,
    model: str,
    req: Any,
    plan: C.OutputPlan,
) -> AsyncIterator[dict]:
    first = True
    outs = engine.stream(input_ids=ids, sampling_params=params, request_id=rid)
    async for out, rows in C.deltas(plan, outs):
        choices = []
        for c, delta, reason in rows:
            if first:
                delta = {"role": "assistant", "content": ""} | delta
            choice = {"index": c.index, "delta": delta, "finish_reason": reason}
            choice["logprobs"] = {"content": _chat_logprobs(engine.tokenizer, c)} if req.logprobs else None
            if req.return_token_ids:  # the prompt's ids once, in the first chunk, as vLLM does
                choice["token_ids"] = c.token_ids
                if first:
                    choice["prompt_token_ids"] = out.prompt_token_ids
            choices.append(choice)
        first = False
        yield _body(rid, "chat.completion.chunk", model, choices, None)


# -- SGLang ---------------------------------------------------------------------------------------
def _sglang(app: FastAPI, engine: AsyncFront, model_name: str, auth: list) -> None:
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/health_generate", dependencies=auth)
    async def health_generate() -> dict:
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        await engine.generate(input_ids=[0], sampling_params=params)
        return {"status": "ok"}

    @app.get("/get_model_info", dependencies=auth)
    async def model_info() -> dict:
        path = str(engine.model_path)
        return {
            "model_path": path,
            "tokenizer_path": path,
            "is_generation": True,
            "served_model_name": model_name,
        }

    @app.get("/get_weight_version", dependencies=auth)
    async def weight_version() -> dict:
        # a round trip to the engine process: off the event loop, which serves the streams meanwhile
        return {"weight_version": str(await asyncio.to_thread(lambda: engine.weight_version))}

    @app.post("/generate", dependencies=auth)
    async def generate(req: P.GenerateRequest) -> Any:
        prompts, batched = _generate_inputs(req)
        sp = req.sampling_params
        params = SamplingParams(
            **sp.model_dump(exclude={"seed"}),
            seed=sp.seed,
            logprobs=req.return_logprob,
            top_logprobs=req.top_logprobs_num,
        )
        rids = _rids(req.rid, len(prompts))
        if req.stream:
            if batched:
                raise ValueError("stream: streams one prompt at a time; send a batch without stream")
            return _sse(_stream_generate(engine, prompts[0], params, rids[0], req.return_logprob))
        calls = [engine.generate(sampling_params=params, request_id=r, **p) for r, p in zip(rids, prompts)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        items = [_sglang_item(o, c, req.return_logprob, o.request_id) for o in results for c in o.outputs]
        return items if batched or params.n > 1 else items[0]

    @app.post("/abort_request", dependencies=auth)
    async def abort_request(req: P.AbortRequest) -> dict:
        if req.abort_all:
            count = await engine.abort_all()
            return {"success": True, "message": f"aborted {count} requests"}
        found = await engine.abort(req.rid)
        return {"success": found, "message": "aborted" if found else f"no request {req.rid!r} in flight"}

    @app.post("/pause_generation", dependencies=auth)
    async def pause(req: P.PauseRequest) -> dict:
        await engine.pause_generation(req.mode)
        return {"success": True, "message": f"paused ({req.mode})"}

    @app.post("/continue_generation", dependencies=auth)
    async def resume_generation() -> dict:
        await engine.continue_generation()
        return {"success": True, "message": "generating"}

    _control(app, "/flush_cache", None, lambda r: engine.flush_cache(), auth)
    _control(
        app,
        "/release_memory_occupation",
        P.TagsRequest,
        lambda r: engine.release_memory_occupation(r.tags),
        auth,
    )
    _control(
        app,
        "/resume_memory_occupation",
        P.TagsRequest,
        lambda r: engine.resume_memory_occupation(r.tags),
        auth,
    )
    _control(
        app,
        "/init_weights_update_group",
        P.InitGroupRequest,
        lambda r: engine.init_weights_update_group(
            r.master_address, r.master_port, r.rank_offset, r.world_size, r.group_name, r.backend
        ),
        auth,
    )
    _control(
        app,
        "/update_weights_from_distributed",
        P.DistributedUpdateRequest,
        lambda r: engine.update_weights_from_distributed(
            r.names, r.dtypes, r.shapes, r.group_name, r.load_format, abort=r.abort_all_requests
        ),
        auth,
    )
    _control(
        app,
        "/destroy_weights_update_group",
        P.DestroyGroupRequest,
        lambda r: engine.destroy_weights_update_group(r.group_name),
        auth,
    )
    _control(
        app,
        "/update_weights_from_disk",
        P.DiskUpdateRequest,
        lambda r: engine.update_weights_from_disk(r.model_path, abort=r.abort_all_requests),
        auth,
    )
    _control(
        app,
        "/update_weights_from_tensor",
        P.TensorUpdateRequest,
        lambda r: engine.update_weights_from_tensor(
            _unpickle(r.serialized_named_tensors, engine.tp_rank),
            r.load_format,
            abort=r.abort_all_requests,
        ),
        auth,
    )


def _control(app: FastAPI, path: str, model: Any, call: Callable[[Any], Awaitable[Any]], auth: list) -> None:
    """A control endpoint answering SGLang's {"success", "message"}; a refusal is success=False."""

    async def run(req: Any) -> dict:
        try:
            result = await call(req)
        except RuntimeError as e:  # refused in this state (requests in flight, memory released...)
            return {"success": False, "message": str(e)}
        return {"success": True, "message": "ok" if result is None else f"ok: {result}"}

    if model is None:

        async def endpoint() -> dict:
            return await run(None)
    else:

        async def endpoint(req: Any) -> dict:
            return await run(req)

        endpoint.__annotations__["req"] = model  # the body model FastAPI validates against

    app.post(path, dependencies=auth)(endpoint)


def _unpickle(serialized: list[str], rank: int) -> Any:
    """This rank's (name, tensor) list. Unpickling runs code chosen by the sender: the endpoint trusts
    whoever can reach it (same host, same user; keep the server on 127.0.0.1 or behind --api-key)."""
    if not 0 <= rank < len(serialized):
        raise ValueError(f"serialized_named_tensors: {len(serialized)} entries, none for TP rank {rank}")
    try:
        return pickle.loads(base64.b64decode(serialized[rank]))
    except Exception as e:
        raise ValueError(f"serialized_named_tensors: cannot decode entry {rank}: {e}") from e


def _generate_inputs(req: P.GenerateRequest) -> tuple[list[dict], bool]:
    if (req.text is None) == (req.input_ids is None):
        raise ValueError("text, input_ids: pass exactly one")
    if req.text is not None:
        return (
            ([{"prompts": req.text}], False)
            if isinstance(req.text, str)
            else ([{"prompts": t} for t in req.text], True)
        )
    ids = req.input_ids
    if ids and isinstance(ids[0], int):  # validated: one token list, all ints
        return [{"input_ids": ids}], False
    return [{"input_ids": p} for p in ids], True


def _rids(rid: str | list[str] | None, count: int) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    rids = [rid] if isinstance(rid, str) else rid
    if len(rids) != count:
        raise ValueError(f"rid: {len(rids)} ids for {count} prompts")
    return rids


def _sglang_item(out: RequestOutput, c: CompletionOutput, logprob: bool, rid: Any) -> dict:
    reason: dict[str, Any] = {"type": c.finish_reason}
    if c.finish_reason == "stop" and c.stop_reason is not None:
        reason["matched"] = c.stop_reason
    if c.finish_reason == "length":
        reason["length"] = len(c.token_ids)
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": reason,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(c.token_ids),
        "weight_version": str(c.weight_versions[-1]) if c.weight_versions else None,
        "weight_versions": c.weight_versions,
    }
    if logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs or [], c.token_ids)]
    return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}


async def _stream_generate(
    engine: AsyncFront, prompt: dict, params: SamplingParams, rid: str, logprob: bool
) -> AsyncIterator[dict]:
    """SGLang streams the output so far in every chunk (cumulative), not deltas."""
    acc: dict[int, CompletionOutput] = {}
    async for out in engine.stream(sampling_params=params, request_id=rid, **prompt):
        for c in out.outputs:
            prev = acc.get(c.index)
            acc[c.index] = c if prev is None else join(prev, c)
            if c.token_ids or c.finish_reason:
                yield _sglang_item(out, acc[c.index], logprob, rid)
