"""AsyncEngine: the Engine's step loop in one background thread, fed by many callers at once.

Callers (asyncio tasks on any event loop, in any thread) submit requests; the loop thread adds them to
the engine between steps, runs `Engine.step`, and hands each output back to the caller's own event loop
with `loop.call_soon_threadsafe`. Everything that touches the engine (adds, aborts, pauses, weight
updates, memory release) runs on the loop thread between two steps, so no call interleaves with a step
and there is no second step loop: this is `Engine.add_request` / `step` / `abort_request`, driven.
ProcessAsyncEngine (rollout/fronts/async_process.py) has the same methods with the loop in a child process,
which keeps the callers' Python work (an HTTP server's) from holding the step loop up.

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
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rollout.api import ENGINE_METHODS, ENGINE_PROPERTIES
from rollout.engine.engine import Engine
from rollout.fronts.async_front import PAUSE_MODES, REQUEST_METHODS, AsyncFront, PauseMode, QueueFullError
from rollout.fronts.stream_deltas import cut, merge
from rollout.outputs import RequestOutput

__all__ = ["AsyncEngine", "PAUSE_MODES", "PauseMode", "QueueFullError"]

log = logging.getLogger("rollout")


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[_Channel, Any]]) -> None:
    def put_all() -> None:
        for ch, item in items:
            ch.queue.put_nowait(item)

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # that loop is closed: nobody is waiting any more
        pass


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

    def join(self, items: list[RequestOutput]) -> RequestOutput:
        return merge(items)

    def delta(self, out: RequestOutput) -> RequestOutput:
        """A streamed request's output as a delta: an abort reports the whole output, so cut off what
        was already streamed."""
        if not self.stream:
            return out
        whole = any(c.finish_reason == "abort" for c in out.outputs)
        outputs = (
            [
                cut(c, self.emitted_tokens.get(c.index, 0), self.emitted_chars.get(c.index, 0))
                for c in out.outputs
            ]
            if whole
            else out.outputs
        )
        for c in outputs:
            self.emitted_tokens[c.index] = self.emitted_tokens.get(c.index, 0) + len(c.token_ids)
            self.emitted_chars[c.index] = self.emitted_chars.get(c.index, 0) + len(c.text)
        return replace(out, outputs=outputs)


class AsyncEngine(AsyncFront):
    """An Engine whose step loop runs in a background thread; see the module docstring.
    ProcessAsyncEngine (fronts/async_process.py) has the same methods with the loop in a child process."""

    def __init__(
        self,
        model: str | Path,
        *,
        max_queued_requests: int | None = None,
        stream_interval: int = 1,
        **engine_options: Any,
    ):
        self._init_front(max_queued_requests, stream_interval)
        self._start(Engine(model, **engine_options), owns_engine=True)

    @classmethod
    def from_engine(
        cls, engine: Engine, *, max_queued_requests: int | None = None, stream_interval: int = 1
    ) -> AsyncEngine:
        """Drive an existing Engine (nothing else may call its request methods while this runs)."""
        self = cls.__new__(cls)
        self._init_front(max_queued_requests, stream_interval)
        self._start(engine, owns_engine=False)
        return self

    def _start(self, engine: Engine, *, owns_engine: bool) -> None:
        self.engine, self._owns_engine = engine, owns_engine
        self.tokenizer = engine.tokenizer
        self.model_path, self.tp_rank = str(engine.config.model), engine.tp.rank
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._channels: dict[Hashable, _Channel] = {}  # loop thread only
        self._stalled = False  # the last step raised with requests left in flight: wait for a command
        self._thread = threading.Thread(target=self._loop, name="rollout-async-engine", daemon=True)
        self._thread.start()

    # -- requests ---------------------------------------------------------------------------------
    async def _open(
        self, rid: Hashable, prompt: str | None, input_ids: Any, params: Any, stream: bool
    ) -> _Channel:
        ch = _Channel(asyncio.get_running_loop(), asyncio.Queue(), stream)
        await self._call(functools.partial(self._add, rid, ch, prompt, input_ids, params))
        return ch

    def _cancel(self, rid: Hashable) -> None:
        self._post(functools.partial(self._abort_now, rid))

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
            for rid in [r for r in self._channels if not self.engine.has_unfinished(r)]:
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
    def close(self) -> None:
        """`shutdown` for callers outside an event loop."""
        with self._count_lock:
            self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()


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
