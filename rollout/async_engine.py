"""AsyncEngine: the Engine's step loop in one background thread, fed by many callers at once.

Callers (asyncio tasks on any event loop, in any thread) submit requests; the loop thread adds them to
the engine between steps, runs `Engine.step`, and hands each output back to the caller's own event loop
with `loop.call_soon_threadsafe`. Everything that touches the engine (adds, aborts, pauses, weight
updates, memory release) runs on the loop thread between two steps, so no call interleaves with a step
and there is no second step loop: this is `Engine.add_request` / `step` / `abort_request`, driven.

Pausing (`pause_generation`) has SGLang's three modes:
- "abort": requests in flight end as aborted, with the tokens and logprobs they have;
- "retract": requests leave the device (their pages are freed) and wait; after `continue_generation`
  they resume from their tokens, recomputing their KV with the weights of then;
- "in_place": requests keep their pages and no step runs. Weight updates and memory releases are refused
  while such requests hold KV (their cache would mix two weight versions) unless called with abort=True.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from rollout.api import ENGINE_METHODS, ENGINE_PROPERTIES
from rollout.engine import Engine
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.sampling import SamplingParams

log = logging.getLogger("rollout")

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES = ("abort", "retract", "in_place")
# the request-level methods AsyncEngine implements itself; every other Engine method is forwarded
REQUEST_METHODS = frozenset(
    {"add_request", "step", "abort_request", "retract_requests", "has_unfinished", "generate", "shutdown"}
)


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[_Channel, Any]]) -> None:
    def put_all() -> None:
        for ch, item in items:
            ch.queue.put_nowait(item)

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # that loop is closed: nobody is waiting any more
        pass


class QueueFullError(RuntimeError):
    """More requests are in flight than `max_queued_requests` allows (the server answers 503)."""


@dataclass(eq=False)
class _Channel:
    """Where one request's outputs go: a queue on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stream: bool
    emitted_tokens: dict[int, int] = field(default_factory=dict)  # per sample, tokens already streamed
    emitted_chars: dict[int, int] = field(default_factory=dict)

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
            pass

    def delta(self, out: RequestOutput) -> RequestOutput:
        """A streamed request's output as a delta: an abort reports the whole output, so cut off what
        was already streamed."""
        if not self.stream:
            return out
        whole = any(c.finish_reason == "abort" for c in out.outputs)
        cut = [
            _cut(c, self.emitted_tokens.get(c.index, 0), self.emitted_chars.get(c.index, 0))
            for c in out.outputs
        ]
        outputs = cut if whole else out.outputs
        for c in outputs:
            self.emitted_tokens[c.index] = self.emitted_tokens.get(c.index, 0) + len(c.token_ids)
            self.emitted_chars[c.index] = self.emitted_chars.get(c.index, 0) + len(c.text)
        return replace(out, outputs=outputs)


def _cut(c: CompletionOutput, tokens: int, chars: int) -> CompletionOutput:
    return replace(
        c,
        token_ids=c.token_ids[tokens:],
        text=c.text[chars:],
        logprobs=None if c.logprobs is None else c.logprobs[tokens:],
        top_logprobs=None if c.top_logprobs is None else c.top_logprobs[tokens:],
        weight_versions=c.weight_versions[tokens:],
    )


class AsyncEngine:
    """An Engine whose step loop runs in a background thread; see the module docstring."""

    def __init__(self, model: str | Path, *, max_queued_requests: int | None = None, **engine_options: Any):
        self._start(Engine(model, **engine_options), owns_engine=True, max_queued=max_queued_requests)

    @classmethod
    def from_engine(cls, engine: Engine, *, max_queued_requests: int | None = None) -> AsyncEngine:
        """Drive an existing Engine (nothing else may call its request methods while this runs)."""
        self = cls.__new__(cls)
        self._start(engine, owns_engine=False, max_queued=max_queued_requests)
        return self

    def _start(self, engine: Engine, *, owns_engine: bool, max_queued: int | None) -> None:
        if max_queued is not None and max_queued < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued}")
        self.engine, self._owns_engine, self.max_queued_requests = engine, owns_engine, max_queued
        self.tokenizer = engine.tokenizer
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._channels: dict[Hashable, _Channel] = {}  # loop thread only
        self._count_lock = threading.Lock()
        self._in_flight = 0  # requests submitted and not yet ended, counted on the callers' side
        self._paused: PauseMode | None = None
        self._stalled = False  # the last step raised with requests left in flight: wait for a command
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rollout-async-engine", daemon=True)
        self._thread.start()

    # -- facts ------------------------------------------------------------------------------------
    @property
    def paused(self) -> PauseMode | None:
        """The pause mode in effect, or None while generating."""
        return self._paused

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    # -- requests ---------------------------------------------------------------------------------
    async def generate(
        self,
        prompts: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        input_ids: list[int] | None = None,
        request_id: Hashable | None = None,
    ) -> RequestOutput:
        """Generate one prompt (text or one token list); returns its whole RequestOutput."""
        final = None
        async for out in self._submit(prompts, sampling_params, input_ids, request_id, stream=False):
            final = out
        assert final is not None
        return final

    async def stream(
        self,
        prompts: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        input_ids: list[int] | None = None,
        request_id: Hashable | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one prompt's outputs as they come: each holds the tokens, logprobs, weight versions
        and text added since the previous one; the last has `finished=True` and the finish reasons."""
        async for out in self._submit(prompts, sampling_params, input_ids, request_id, stream=True):
            yield out

    async def _submit(
        self,
        prompt: Any,
        params: SamplingParams | None,
        input_ids: Any,
        request_id: Hashable | None,
        *,
        stream: bool,
    ) -> AsyncIterator[RequestOutput]:
        if prompt is not None and not isinstance(prompt, str):
            raise TypeError("prompts must be one str (AsyncEngine takes one prompt per call)")
        rid = uuid.uuid4().hex if request_id is None else request_id
        self._reserve()
        ch = _Channel(asyncio.get_running_loop(), asyncio.Queue(), stream)
        added = finished = False
        try:
            await self._call(functools.partial(self._add, rid, ch, prompt, input_ids, params))
            added = True
            while not finished:
                item = await ch.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._release()
            if added and not finished:  # the caller went away (cancelled, disconnected): free its pages
                self._post(functools.partial(self._abort_now, rid))

    def _reserve(self) -> None:
        with self._count_lock:
            if self._closed or self._stopping:
                raise RuntimeError("the AsyncEngine was shut down")
            if self.max_queued_requests is not None and self._in_flight >= self.max_queued_requests:
                raise QueueFullError(
                    f"{self._in_flight} requests in flight (max_queued_requests={self.max_queued_requests})"
                )
            self._in_flight += 1

    def _release(self) -> None:
        with self._count_lock:
            self._in_flight -= 1

    def _add(self, rid: Hashable, ch: _Channel, prompt: Any, input_ids: Any, params: Any) -> None:
        if rid in self._channels:
            raise ValueError(f"request_id {rid!r} is already in flight")
        self.engine.add_request(rid, input_ids, params, prompt=prompt, stream=ch.stream)
        self._channels[rid] = ch

    async def abort(self, request_id: Hashable) -> bool:
        """End a request in flight with finish_reason "abort"; its caller gets the tokens and logprobs
        it has, and its pages are freed at once. False when no such request is in flight."""
        return await self._call(functools.partial(self._abort_now, request_id))

    async def abort_all(self) -> int:
        """Abort every request in flight; returns how many."""
        return await self._call(self._abort_all_now)

    def _abort_now(self, rid: Hashable) -> bool:
        out = self.engine.abort_request(rid)
        ch = self._channels.pop(rid, None)
        if out is not None and ch is not None:
            ch.put(ch.delta(out))
        return out is not None

    def _abort_all_now(self) -> int:
        return sum(self._abort_now(rid) for rid in list(self._channels))

    # -- pause ------------------------------------------------------------------------------------
    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Stop stepping; see the module docstring for the modes. New requests queue until continue."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._call(functools.partial(self._pause_now, mode))

    def _pause_now(self, mode: PauseMode) -> None:
        self._paused = mode
        if mode == "abort":
            self._abort_all_now()
        if mode in ("abort", "retract"):
            # nothing holds KV now: updates and releases may go through with requests queued
            self.engine.retract_requests()

    async def continue_generation(self) -> None:
        """Resume stepping; retracted requests recompute their KV and go on."""
        await self._call(self._continue_now)

    def _continue_now(self) -> None:
        self._paused = None

    # -- the loop thread --------------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Run `fn` on the loop thread between two steps; the caller's loop gets its result."""
        return asyncio.wrap_future(self._post(fn))

    def _post(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed:
            fut.set_exception(RuntimeError("the AsyncEngine was shut down"))
            return fut
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    def _loop(self) -> None:
        while True:
            self._wake.clear()
            ran = self._run_commands()
            self._stalled = self._stalled and not ran
            if self._stopping:
                break
            if self._paused or self._stalled or not self.engine.has_unfinished():
                self._wake.wait()
                continue
            self._step()
        self._stop()

    def _run_commands(self) -> bool:
        ran = False
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # the caller gets it; the loop goes on
                fut.set_exception(e)

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:
            log.exception("step failed")
            self._stalled = True  # e.g. memory released under retracted requests: wait for a resume
            for rid in [r for r in self._channels if r not in self.engine.scheduler.requests]:
                self._channels.pop(rid).put(e)  # a failed step aborted these: their callers get the error
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Channel, RequestOutput]]] = {}
        for out in outs:
            ch = (
                self._channels.pop(out.request_id, None)
                if out.finished
                else self._channels.get(out.request_id)
            )
            if ch is not None:
                by_loop.setdefault(ch.loop, []).append((ch, ch.delta(out)))
        for loop, items in by_loop.items():  # one wake-up of each caller loop per step, not one per request
            _deliver(loop, items)

    def _stop(self) -> None:
        """Abort what is in flight (callers get their partial outputs), refuse what is still queued."""
        self._abort_all_now()
        self._closed = True
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the AsyncEngine was shut down"))
        if self._owns_engine:
            self.engine.shutdown()

    # -- lifetime ---------------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Stop the loop thread; requests in flight end as aborted. Safe to call twice."""
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """`shutdown` for callers outside an event loop."""
        with self._count_lock:
            self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()


def _forward(name: str) -> Callable[..., Any]:
    """An Engine method as a coroutine run on the loop thread between steps. With abort=True the
    requests in flight are aborted here first, so their callers get their outputs at once."""
    method = getattr(Engine, name)
    sig = inspect.signature(method)

    async def call(self: AsyncEngine, *args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(self.engine, *args, **kwargs)

        def run() -> Any:
            if bound.arguments.get("abort"):
                self._abort_all_now()
                bound.arguments["abort"] = False
            return method(*bound.args, **bound.kwargs)

        return await self._call(run)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = method.__doc__
    call.__signature__ = sig  # type: ignore[attr-defined]
    return call


def _property(name: str) -> property:
    return property(lambda self: getattr(self.engine, name), doc=getattr(Engine, name).__doc__)


for _name in ENGINE_METHODS:
    if _name not in REQUEST_METHODS:
        setattr(AsyncEngine, _name, _forward(_name))
for _name in ENGINE_PROPERTIES:
    setattr(AsyncEngine, _name, _property(_name))
