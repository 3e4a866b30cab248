"""The callers' side shared by AsyncEngine (the step loop in a thread) and ProcessAsyncEngine (the step
loop in a child process): one prompt per call, the count of requests in flight, the queue limit.

A subclass opens a request (`_open`: returns its Channel, the asyncio.Queue its outputs, or an
exception, arrive on, and how queued items become one output) and aborts one whose caller went away
(`_cancel`); `close` stops it.
"""

from __future__ import annotations

import abc
import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Hashable
from typing import Any, Protocol

from rollout.api import STEP_LOOP_METHODS
from rollout.engine.driver import PauseMode
from rollout.fronts.stream_deltas import merge
from rollout.outputs import RequestOutput
from rollout.sampling import SamplingParams

# the request-level methods the fronts implement themselves; every other Engine method is forwarded
REQUEST_METHODS = frozenset({*STEP_LOOP_METHODS, "shutdown"})


class Channel(Protocol):
    """One request's way to its caller: the queue the producer puts items on, and how the items that
    queued up while the caller was busy become one RequestOutput (exceptions are raised first)."""

    loop: asyncio.AbstractEventLoop  # the caller's
    queue: asyncio.Queue

    def join(self, items: list) -> RequestOutput: ...


def deliver(items: list[tuple[Channel, Any]]) -> list[asyncio.AbstractEventLoop]:
    """Hand outputs (or exceptions) to their callers from any thread: one wake-up of each caller loop,
    not one per request. Returns the loops woken."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Channel, Any]]] = {}
    woken = []
    for ch, item in items:
        by_loop.setdefault(ch.loop, []).append((ch, item))
    for loop, batch in by_loop.items():

        def put_all(batch: list = batch) -> None:
            for ch, item in batch:
                ch.queue.put_nowait(item)

        try:
            loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # that loop is closed: nobody is waiting any more
            continue
        woken.append(loop)
    return woken


class QueueFullError(RuntimeError):
    """More requests are in flight than `max_queued_requests` allows (the server answers 503)."""


class AsyncFront(abc.ABC):
    """generate / stream / the in-flight count over a subclass's `_open` and `_cancel`."""

    tokenizer: Any
    model_path: str  # the checkpoint folder
    tp_rank: int  # this engine's rank in its tensor-parallel group

    def _init_front(self, max_queued: int | None, stream_interval: int = 1) -> None:
        if max_queued is not None and max_queued < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued}")
        if not isinstance(stream_interval, int) or isinstance(stream_interval, bool) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an int >= 1, got {stream_interval!r}")
        self.max_queued_requests = max_queued
        self.stream_interval = stream_interval
        self._count_lock = threading.Lock()
        self._in_flight = 0  # requests submitted and not yet ended, counted on the callers' side
        self._paused: PauseMode | None = None
        self._stopping = False
        self._closed = False

    # -- facts ------------------------------------------------------------------------------------
    @property
    def paused(self) -> PauseMode | None:
        """The pause mode this front set, or None while generating (with several fronts over one
        engine process, another may have paused it: the engine's state is the worker's)."""
        return self._paused

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    # -- requests ---------------------------------------------------------------------------------
    def chat_session(self, **options: Any) -> Any:
        """A token-exact multi-turn chat over this engine (rollout.chat.session.ChatSession: tools,
        tool_parser, reasoning_parser, chat_template_kwargs)."""
        from rollout.chat.session import ChatSession

        return ChatSession(self, **options)

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
        and text added since the previous one (the deltas that queued up while the caller was busy
        come as one); the last has `finished=True` and the finish reasons. With `stream_interval` N
        (SGLang's and vLLM's --stream-interval) the first output comes at once, then one each N
        tokens of a sample, then the last."""
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
            hint = "; token ids go in input_ids=" if isinstance(prompt, (list, tuple)) else ""
            raise TypeError(f"prompts must be one str (one prompt per call){hint}")
        rid = uuid.uuid4().hex if request_id is None else request_id
        self._reserve()
        added = finished = False
        held: RequestOutput | None = None  # deltas kept back until stream_interval tokens
        try:
            ch = await self._open(rid, prompt, input_ids, params, stream)
            queue, added, first = ch.queue, True, True
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                out = ch.join(items) if held is None else merge([held, ch.join(items)])
                finished = out.finished
                if not (first or finished) and _new_tokens(out) < self.stream_interval:
                    held = out
                    continue
                held, first = None, False
                yield out
        finally:
            self._release()
            if added and not finished:  # the caller went away (cancelled, disconnected): free its pages
                self._cancel(rid)

    @abc.abstractmethod
    async def _open(
        self, rid: Hashable, prompt: str | None, input_ids: Any, params: Any, stream: bool
    ) -> Channel:
        """Add the request; returns the channel its outputs (or an exception) arrive on."""

    @abc.abstractmethod
    def _cancel(self, rid: Hashable) -> None:
        """Abort a request whose caller went away, without waiting."""

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

    # -- lifetime ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def close(self) -> None:
        """`shutdown` for callers outside an event loop."""

    async def shutdown(self) -> None:
        """Stop the step loop; requests in flight end as aborted. Safe to call twice."""
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    async def __aenter__(self) -> AsyncFront:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()


def _new_tokens(out: RequestOutput) -> int:
    """The most tokens a sample of a delta holds."""
    return max((len(c.token_ids) for c in out.outputs), default=0)
