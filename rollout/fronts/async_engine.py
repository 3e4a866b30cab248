"""AsyncEngine: the Engine's step loop in one background thread, fed by many callers at once.

Callers (asyncio tasks on any event loop, in any thread) submit requests; the loop thread runs the
engine's `StepDriver` (rollout/engine/driver.py), which adds them between steps and runs `Engine.step`,
and this front hands each output back to the caller's own event loop with `loop.call_soon_threadsafe`.
Everything that touches the engine (adds, aborts, pauses, weight updates, memory release) runs on the
loop thread between two steps, so no call interleaves with a step and there is no second step loop.
ProcessAsyncEngine (rollout/fronts/async_process.py) has the same methods with the loop in a child process,
which keeps the callers' Python work (an HTTP server's) from holding the step loop up.

Pausing (`pause_generation`) has SGLang's three modes; see the driver.
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
from rollout.engine.driver import PAUSE_MODES, PauseMode, StepDriver
from rollout.engine.engine import Engine
from rollout.fronts.async_front import (
    REQUEST_METHODS,
    AsyncFront,
    QueueFullError,
    deliver,
)
from rollout.fronts.stream_deltas import cut, merge
from rollout.outputs import RequestOutput

__all__ = ["AsyncEngine", "PAUSE_MODES", "PauseMode", "QueueFullError"]

log = logging.getLogger("rollout")


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
        self._front = _Front(lambda: self._stopping)
        self._driver = StepDriver(engine, self._front)  # loop thread only
        self._thread = threading.Thread(target=self._loop, name="rollout-async-engine", daemon=True)
        self._thread.start()

    # -- requests ---------------------------------------------------------------------------------
    async def _open(
        self, rid: Hashable, prompt: str | None, input_ids: Any, params: Any, stream: bool
    ) -> _Channel:
        ch = _Channel(asyncio.get_running_loop(), asyncio.Queue(), stream)
        add = self._driver.add
        await self._call(functools.partial(add, rid, input_ids, params, ch, prompt=prompt, stream=stream))
        return ch

    def _cancel(self, rid: Hashable) -> None:
        self._post(functools.partial(self._driver.abort, rid))

    async def abort(self, request_id: Hashable) -> bool:
        """End a request in flight with finish_reason "abort"; its caller gets the tokens and logprobs
        it has, and its pages are freed at once. False when no such request is in flight."""
        return await self._call(functools.partial(self._driver.abort, request_id))

    async def abort_all(self) -> int:
        """Abort every request in flight; returns how many."""
        return await self._call(self._driver.abort_all)

    # -- pause ------------------------------------------------------------------------------------
    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Stop stepping; see the driver's docstring for the modes. New requests queue until continue."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._call(functools.partial(self._pause_now, mode))

    def _pause_now(self, mode: PauseMode) -> None:
        self._driver.pause(mode)
        self._paused = mode

    async def continue_generation(self) -> None:
        """Resume stepping; retracted requests recompute their KV and go on."""
        await self._call(self._continue_now)

    def _continue_now(self) -> None:
        self._driver.resume()
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
        self._front.commands.put((fn, fut))
        self._front.wake.set()
        return fut

    def _loop(self) -> None:
        self._driver.run()
        self._stop()

    def _stop(self) -> None:
        """Abort what is in flight (callers get their partial outputs), refuse what is still queued."""
        self._driver.close()
        self._closed = True
        while True:
            try:
                _, fut = self._front.commands.get_nowait()
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
        self._front.wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()


class _Front:
    """AsyncEngine's side of its step driver, on the loop thread: the commands callers posted, and the
    outputs' way back to the callers' event loops."""

    def __init__(self, stopping: Callable[[], bool]):
        self.commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self.wake = threading.Event()  # set with each command posted, and to close
        self.stopping = stopping

    def poll(self, block: bool) -> bool | None:
        """Run the commands posted (waiting for one first when the driver is idle); None once closing."""
        if block:
            self.wake.wait()
        self.wake.clear()
        ran = False
        while True:
            try:
                fn, fut = self.commands.get_nowait()
            except queue.Empty:
                break
            ran = True
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # the caller gets it; the loop goes on
                fut.set_exception(e)
        return None if self.stopping() else ran

    def deliver(self, items: list[tuple[_Channel | None, RequestOutput]]) -> None:
        deliver([(ch, ch.delta(out)) for ch, out in items if ch is not None])

    def failed(self, error: Exception, ended: list[tuple[Hashable, _Channel]]) -> None:
        log.error("step failed", exc_info=error)
        for _, ch in ended:  # a failed step aborted these: their callers get the error
            ch.put(error)


def _forward(name: str) -> Callable[..., Any]:
    """An Engine method as a coroutine run by the driver between steps (with abort=True it aborts the
    requests in flight first, so their callers get their outputs at once)."""
    method = getattr(Engine, name)
    sig = inspect.signature(method)

    async def call(self: AsyncEngine, *args: Any, **kwargs: Any) -> Any:
        sig.bind(self.engine, *args, **kwargs)  # a wrong call fails here, in the caller
        return await self._call(functools.partial(self._driver.call, name, args, kwargs))

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
