"""The FastAPI app: OpenAI completions/chat, SGLang's /generate and control endpoints, over an AsyncEngine
or a ProcessAsyncEngine (the same methods; the step loop in a thread or in a child process).

Every request goes to the one engine (its step loop batches them); the handlers only translate JSON.
Bad input is a 400 naming the field; a full queue is a 503; the server keeps serving after either.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from rollout.cache.routes import encode_routes
from rollout.fronts.async_front import AsyncFront
from rollout.fronts.stream_deltas import join
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.process.child import freeze_heap
from rollout.sampling import SamplingParams
from rollout.serve import chat as C
from rollout.serve import errors, inputs
from rollout.serve import protocol as P
from rollout.serve import tensor_wire as wire
from rollout.serve.bounds import Names, check_counts, check_tokens
from rollout.serve.disconnect import ClientGone, unless_disconnected
from rollout.serve.errors import ApiError
from rollout.serve.guard import Guard, api_key_check
from rollout.serve.policy import Policy

OPENAI = Names()
COMPLETIONS = Names(top_logprobs="logprobs")
SGLANG = Names(
    n="sampling_params.n",
    max_tokens="sampling_params.max_new_tokens",
    top_logprobs="top_logprobs_num",
    prompts="input_ids",
)


def build_app(
    engine: AsyncFront,
    *,
    model_name: str,
    api_key: str | None = None,
    before_shutdown: Callable[[], None] | None = None,
    parsers: C.ChatParsers | None = None,
    policy: Policy | None = None,
) -> FastAPI:
    """The app over `engine`; it shuts the engine down when the server stops, after `before_shutdown`
    (run in a thread: the other server processes over the engine stop first). `parsers`: the
    tool-call and reasoning parsers chat completions split their outputs with. `policy`: the Host
    allow-list, body caps, per-request bounds and the pickle opt-in (rollout/serve/policy.py)."""
    policy = policy or Policy()
    if policy.allow_pickle and api_key is None:
        raise ValueError(f"{wire.PICKLE_FLAG} needs an API key: unpickling runs the sender's code")

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

    # with a key, the schema pages are off: they would list every control endpoint to anyone
    pages = {} if api_key is None else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(lifespan=lifespan, title="rollout", **pages)
    app.state.engine = engine
    app.state.policy = policy
    app.add_middleware(Guard, hosts=policy.allowed_hosts, limits=policy.body_limits())
    errors.install(app, alive=lambda: _alive(engine))

    @app.exception_handler(ClientGone)
    async def gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left

    auth = [Depends(api_key_check(api_key))] if api_key is not None else []  # none: no per-request work
    _openai(app, engine, model_name, auth, parsers or C.ChatParsers(), policy)
    _sglang(app, engine, model_name, auth, policy)
    return app


def _alive(engine: AsyncFront) -> bool:
    return bool(getattr(engine, "alive", True))


def _check_model(model: str | None, model_name: str) -> None:
    if model is not None and model != model_name:
        raise ApiError(
            404,
            f"model {model!r} does not exist; this server serves {model_name!r}",
            param="model",
            code="model_not_found",
        )


# -- OpenAI ---------------------------------------------------------------------------------------
def _openai(
    app: FastAPI, engine: AsyncFront, model_name: str, auth: list, parsers: C.ChatParsers, policy: Policy
) -> None:
    tok = engine.tokenizer

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "rollout"}
        return {"object": "list", "data": [card | {"max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: P.CompletionRequest, request: Request) -> Any:
        _check_model(req.model, model_name)
        raw, _ = inputs.token_lists(req.prompt, "prompt")
        check_counts(policy.bounds, COMPLETIONS, n=req.n, top_logprobs=req.logprobs or 0, prompts=len(raw))
        if req.best_of is not None:
            check_counts(
                policy.bounds, replace(OPENAI, n="best_of"), n=req.best_of, top_logprobs=0, prompts=1
            )
            if req.best_of != req.n:
                raise ApiError(
                    400, "best_of: only best_of == n is served (no ranking of extra samples)", param="best_of"
                )
        params = _params(req, req.max_tokens, req.logprobs is not None, req.logprobs or 0, _COMPLETION_NAMES)
        ids = await inputs.ids_of(tok, raw, "prompt")
        _check_tokens(policy, COMPLETIONS, ids, params, engine)
        prompts = [{"input_ids": p} for p in ids]
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return _sse(_stream_completion(engine, prompts, params, rid, model_name, req))
        outs = await unless_disconnected(request, _gather(engine, prompts, params, rid))
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
    async def chat(req: P.ChatRequest, request: Request) -> Any:
        _check_model(req.model, model_name)
        check_counts(policy.bounds, OPENAI, n=req.n, top_logprobs=req.top_logprobs, prompts=1)
        names = _CHAT_NAMES | {"max_new_tokens": _chat_max_field(req)}
        params = _params(req, _chat_max_tokens(req), req.logprobs, req.top_logprobs, names)
        prompt, plan = await inputs.off_loop(
            C.prepare, req, tok, parsers, chars=inputs.message_chars(req.messages)
        )
        ids = prompt.token_ids
        _check_tokens(policy, replace(OPENAI, max_tokens=names["max_new_tokens"]), [ids], params, engine)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return _sse(_stream_chat(engine, ids, params, rid, model_name, req, plan))
        out = await unless_disconnected(
            request, engine.generate(input_ids=ids, sampling_params=params, request_id=rid)
        )
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


# SamplingParams' field names as each API's client spelled them (errors name the client's field)
_COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "top_logprobs": "logprobs", "logprobs": "logprobs"}
_CHAT_NAMES = {"max_new_tokens": "max_tokens", "top_logprobs": "top_logprobs", "logprobs": "logprobs"}
_SGLANG_NAMES = {
    "max_new_tokens": "sampling_params.max_new_tokens",
    "top_logprobs": "top_logprobs_num",
    "logprobs": "return_logprob",
    "seed": "sampling_params.sampling_seed",
}
CHAT_DEFAULT_MAX_TOKENS = 128


def _chat_max_tokens(req: P.ChatRequest) -> int:
    """max_completion_tokens, else max_tokens, else the default: a 0 is the client's 0, not unset."""
    for value in (req.max_completion_tokens, req.max_tokens):
        if value is not None:
            return value
    return CHAT_DEFAULT_MAX_TOKENS


def _chat_max_field(req: P.ChatRequest) -> str:
    return "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"


def _params(req: Any, max_tokens: int, logprobs: bool, top: int, names: dict[str, str]) -> SamplingParams:
    return _sampling(
        names,
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


def _sampling(names: dict[str, str], **fields: Any) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        raise errors.rename_fields(e, names) from None


def _check_tokens(
    policy: Policy, names: Names, ids: list[list[int]], params: SamplingParams, engine: AsyncFront
) -> None:
    lens = [len(p) for p in ids]
    check_tokens(
        policy.bounds,
        names,
        prompt_lens=lens,
        n=params.n,
        max_tokens=params.max_new_tokens,
        max_model_len=engine.max_model_len,
    )


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


def _completion_logprobs(tok: Any, c: CompletionOutput, start: int = 0) -> dict:
    """OpenAI's legacy logprobs; text_offset[i] is where token i's text starts in the completion
    (from `start`: the characters streamed before this chunk)."""
    tops = c.top_logprobs or [{} for _ in c.token_ids]
    pieces = [_piece(tok, t) for t in c.token_ids]
    offsets, at = [], start
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {
        "tokens": pieces,
        "token_logprobs": list(c.logprobs or []),
        "top_logprobs": [{_piece(tok, t): lp for t, lp in top.items()} for top in tops],
        "text_offset": offsets,
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
    """Server-sent events ending in [DONE]. An error after the first chunk (the status line is sent)
    comes as one event in OpenAI's error shape, then [DONE]: a stream never ends cut off."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except Exception as e:
            status = 503 if isinstance(e, RuntimeError) else getattr(e, "status", 400)
            message = getattr(e, "message", str(e))
            yield f"data: {json.dumps(errors.body(status, message, param=getattr(e, 'param', None)))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _stream_completion(
    engine: AsyncFront, prompts: list[dict], params: SamplingParams, rid: str, model: str, req: Any
) -> AsyncIterator[dict]:
    for i, p in enumerate(prompts):  # one prompt after the other: each streams as it is generated
        first = True
        sent: dict[int, int] = {}  # characters sent per sample, for text_offset
        async for out in engine.stream(sampling_params=params, request_id=f"{rid}-{i}", **p):
            choices = []
            for c in out.outputs:
                choice = {"index": i * params.n + c.index, "text": c.text, "finish_reason": _reason(c)}
                choice["logprobs"] = (
                    _completion_logprobs(engine.tokenizer, c, sent.get(c.index, 0))
                    if req.logprobs is not None
                    else None
                )
                sent[c.index] = sent.get(c.index, 0) + len(c.text)
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
def _sglang(app: FastAPI, engine: AsyncFront, model_name: str, auth: list, policy: Policy) -> None:
    @app.get("/health")
    async def health() -> dict:
        if not _alive(engine):
            raise errors.EngineUnavailable("the engine process is gone", code="engine_dead")
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
    async def generate(req: P.GenerateRequest, request: Request) -> Any:
        field = "text" if req.text is not None else "input_ids"
        raw, batched = _generate_inputs(req)
        sp = req.sampling_params
        names = replace(SGLANG, prompts=field)
        check_counts(policy.bounds, names, n=sp.n, top_logprobs=req.top_logprobs_num, prompts=len(raw))
        params = _sampling(
            _SGLANG_NAMES,
            **sp.model_dump(exclude={"seed"}),
            seed=sp.seed,
            logprobs=req.return_logprob,
            top_logprobs=req.top_logprobs_num,
            return_routed_experts=req.return_routed_experts,
        )
        rids = _rids(req.rid, len(raw))
        ids = await inputs.ids_of(engine.tokenizer, raw, field)
        _check_tokens(policy, names, ids, params, engine)
        prompts = [{"input_ids": p} for p in ids]
        if req.stream:
            if batched:
                raise ValueError("stream: streams one prompt at a time; send a batch without stream")
            return _sse(_stream_generate(engine, prompts[0], params, rids[0], req.return_logprob))
        results = await unless_disconnected(request, _gather_rids(engine, prompts, params, rids))
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
        lambda r: _update_from_tensor(engine, r, policy.allow_pickle),
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


async def _update_from_tensor(engine: AsyncFront, r: P.TensorUpdateRequest, allow_pickle: bool) -> Any:
    """This rank's entry decoded by its format (never unpickled unless the operator opted in), off
    the event loop: a large payload takes a while to parse."""
    rank = engine.tp_rank
    if not 0 <= rank < len(r.serialized_named_tensors):
        raise ValueError(
            f"serialized_named_tensors: {len(r.serialized_named_tensors)} entries, none for TP rank {rank}"
        )
    entry = r.serialized_named_tensors[rank]
    named = await asyncio.to_thread(wire.decode, entry, r.format, allow_pickle=allow_pickle)
    if r.format == "cuda_ipc" and hasattr(engine, "pid"):
        # the engine is in a worker process: hand it a copy of memory this process opened from the
        # trainer's handles (CUDA IPC does not promise that an imported allocation can be exported again)
        named = [(name, t.clone()) for name, t in named]
    return await engine.update_weights_from_tensor(named, r.load_format, abort=r.abort_all_requests)


def _generate_inputs(req: P.GenerateRequest) -> tuple[list[Any], bool]:
    """The prompts (texts or id lists) and whether it was a batch."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "text, input_ids: pass exactly one", param="input_ids")
    if req.text is not None:
        return inputs.token_lists(req.text, "text")
    return inputs.token_lists(req.input_ids, "input_ids")


async def _gather_rids(
    engine: AsyncFront, prompts: list[dict], params: SamplingParams, rids: list[str]
) -> list[RequestOutput]:
    calls = [engine.generate(sampling_params=params, request_id=r, **p) for r, p in zip(rids, prompts)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)


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
    if c.routed_experts is not None:  # int32 [seq_len - 1, MoE layers, top_k], base64 (as SGLang)
        meta["routed_experts"] = encode_routes(c.routed_experts)
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
