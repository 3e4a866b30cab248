"""ProcessAsyncEngine: AsyncEngine's methods with the Engine and its step loop in a spawned child process.

In AsyncEngine the step loop is a thread of the caller's process, so under many streaming HTTP clients
the step loop, the event loop's per-token SSE and JSON work and the detokenizer share one interpreter
lock, and the device waits for Python. Here the child (rollout/process/worker.py) owns the Engine and
does only `add_request` / `step` / aborts / RL calls; this process keeps the tokenizer (text prompts
are encoded here, stream text is decoded here) and the callers.

Two threads of this process talk to the child over one pipe:
- the sender sends every command queued since its last send as one message (adds of many concurrent
  callers cross together; a caller never blocks on the pipe);
- the reader receives the child's updates: answers resolve the callers' futures, outputs and token
  deltas go to their callers' queues, and each caller's event loop is woken once per update. Once
  those loops have run the callers they woke, the sender acknowledges the update (or after
  ACK_AFTER_S, whatever the loops): the child sends the next only then, so while the callers are busy
  its steps gather into fewer, larger updates.
If the child dies, every pending request and call fails with "the engine process died", and the
engine refuses new work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import logging
import multiprocessing as mp
import threading
import time
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rollout.api import CONSTANT_PROPERTIES, ENGINE_METHODS, ENGINE_PROPERTIES
from rollout.engine.chat import load_tokenizer
from rollout.engine.driver import PAUSE_MODES, PauseMode
from rollout.engine.engine import Engine
from rollout.engine.inputs import normalize_prompts
from rollout.fronts.async_front import REQUEST_METHODS, AsyncFront, deliver
from rollout.fronts.stream_deltas import StreamedText, merge
from rollout.outputs import RequestOutput, TokenDelta
from rollout.process import ipc
from rollout.process import worker as W
from rollout.process.child import reap, serve_child
from rollout.process.engine_process import encode_args
from rollout.process.wire import CLOSE, GET, Call, Reply, Update, unwrap
from rollout.sampling import SamplingParams

log = logging.getLogger("rollout")

CLOSE_TIMEOUT_S = 60.0  # how long close() waits for the child to shut its engine down
ACK_AFTER_S = 0.05  # the longest an update's ACK waits for its callers' loops (one that stopped running
# must not hold back every other caller's outputs)


@dataclass(eq=False)
class _Channel:
    """Where one request's outputs go: a queue on the caller's event loop (and, when streamed, the
    state that turns token deltas into text).

    The reader thread queues the worker's items as they are (lists of one step's TokenDeltas, the
    final RequestOutput); the caller turns what queued up into one output (`join`). So the reader, which
    every caller waits on, does no per-token work, and a caller that fell behind decodes and builds
    one output for several steps."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    prompt: str | None  # the text, when given as text (the child only saw its tokens)
    text: StreamedText | None  # None: not streamed, only the whole final output comes

    def join(self, items: list[list[TokenDelta] | RequestOutput]) -> RequestOutput:
        outs: list[RequestOutput] = []
        pending: list[TokenDelta] = []
        for item in items:
            if isinstance(item, RequestOutput):
                if pending:
                    outs.append(self.text.tokens(pending))
                    pending = []
                outs.append(self.final(item))
            else:
                pending += item
        if pending:
            outs.append(self.text.tokens(pending))
        return merge(outs)

    def final(self, out: RequestOutput) -> RequestOutput:
        if self.text is not None:
            return self.text.final(out)
        return out if self.prompt is None else replace(out, prompt=self.prompt)


class ProcessAsyncEngine(AsyncFront):
    """AsyncEngine's methods (generate, stream, abort, pause_generation, the Engine's RL methods as
    coroutines, its properties) with the Engine in a child process; see the module docstring."""

    def __init__(
        self,
        model: str | Path,
        *,
        max_queued_requests: int | None = None,
        stream_interval: int = 1,
        start_timeout: float = 900.0,
        **engine_options: Any,
    ):
        self._init_front(max_queued_requests, stream_interval)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=serve_child, args=(child, str(model), engine_options, W.run), name="rollout-engine-worker"
        )
        self._proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _stop_worker, self._conn, self._proc)
        self.tokenizer = load_tokenizer(str(model))  # while the child loads the model
        self._facts = self._wait_started(start_timeout)
        self._start_threads()

    @classmethod
    def attach(
        cls,
        address: str,
        authkey: bytes,
        *,
        max_queued_requests: int | None = None,
        stream_interval: int = 1,
        timeout: float = 60.0,
    ) -> ProcessAsyncEngine:
        """Another front over the engine process of a ProcessAsyncEngine that called `listen` (from
        any process of this host; `python -m rollout.serve --api-server-count N` runs N such fronts).
        Its requests and streams are its own; aborts, pauses, weight updates and memory calls act on
        the one engine. Closing it aborts its own requests only; the engine lives as long as the
        ProcessAsyncEngine that started it."""
        from multiprocessing.connection import Client

        self = cls.__new__(cls)
        self._init_front(max_queued_requests, stream_interval)
        self._conn, self._proc = Client(address, family="AF_UNIX", authkey=authkey), None
        self._finalizer = weakref.finalize(self, _detach, self._conn)
        self._facts = self._wait_started(timeout)
        self.tokenizer = load_tokenizer(self._facts["model_path"])
        self._start_threads()
        return self

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Block until the link to the engine process is gone (closed, or the process ended); returns
        whether it is."""
        self._reader.join(timeout)
        return not self._reader.is_alive()

    def listen(self) -> tuple[str, bytes]:
        """Let other fronts attach to this engine (`attach`); returns the address and key they need.
        The address is a Unix socket of this host, open until the engine process ends."""
        return self._post(W.LISTEN).result()

    def _start_threads(self) -> None:
        self.model_path, self.tp_rank = self._facts["model_path"], self._facts["tp_rank"]
        self._lock = threading.Condition()  # guards the tables below and wakes the sender
        self._channels: dict[Hashable, _Channel] = {}
        self._futures: dict[int, tuple[concurrent.futures.Future, set]] = {}
        self._outbox: list[Call] = []
        self._ack_owed: tuple[int, int, float] | None = None  # (update number, loops left, deadline)
        self._updates = 0  # updates applied
        self._ids = itertools.count(1)
        self._dead: str | None = None  # why the child is gone, once it is
        self._sender = threading.Thread(target=self._send_loop, name="rollout-worker-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="rollout-worker-read", daemon=True)
        self._sender.start()
        self._reader.start()

    def _wait_started(self, timeout: float) -> dict:
        if not self._conn.poll(timeout):
            self._finalizer()
            raise TimeoutError(f"the engine process did not start within {timeout:g}s")
        try:
            return unwrap(self._conn.recv())
        except BaseException:
            self._finalizer()
            raise

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._facts["pid"]

    @property
    def alive(self) -> bool:
        return self._dead is None and (self._proc is None or self._proc.is_alive())

    # -- requests ---------------------------------------------------------------------------------
    async def _open(
        self, rid: Hashable, prompt: str | None, input_ids: Any, params: Any, stream: bool
    ) -> _Channel:
        if prompt is not None:  # text is encoded here, as Engine.add_request would encode it
            input_ids = normalize_prompts(prompt, None, self.tokenizer)[0][0]
        text = None
        if stream:
            p = params or SamplingParams()
            ids = list(input_ids) if isinstance(input_ids, list) else []
            text = StreamedText(ids, prompt, self.tokenizer, p.skip_special_tokens, p.stream_holdback)
        ch = _Channel(asyncio.get_running_loop(), asyncio.Queue(), prompt, text)
        with self._lock:
            if rid in self._channels:
                raise ValueError(f"request_id {rid!r} is already in flight")
            self._channels[rid] = ch  # before the add crosses: the first outputs may follow its answer
        try:
            await self._call(W.ADD, rid, input_ids, params, stream)
        except BaseException:
            with self._lock:
                if self._channels.get(rid) is ch:
                    del self._channels[rid]
            raise
        return ch

    def _cancel(self, rid: Hashable) -> None:
        self._post(W.ABORT, rid)

    async def abort(self, request_id: Hashable) -> bool:
        """End a request in flight with finish_reason "abort"; its caller gets the tokens and logprobs
        it has, and its pages are freed at once. False when no such request is in flight."""
        return await self._call(W.ABORT, request_id)

    async def abort_all(self) -> int:
        """Abort every request in flight; returns how many."""
        return await self._call(W.ABORT_ALL)

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Stop stepping; see AsyncEngine's module docstring for the modes. New requests queue until
        continue."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._call(W.PAUSE, mode)
        self._paused = mode

    async def continue_generation(self) -> None:
        """Resume stepping; retracted requests recompute their KV and go on."""
        await self._call(W.CONTINUE)
        self._paused = None

    # -- commands ---------------------------------------------------------------------------------
    def _call(self, method: str, *args: Any) -> asyncio.Future:
        return asyncio.wrap_future(self._post(method, *args))

    def _post(self, method: str, *args: Any, devices: set | None = None) -> concurrent.futures.Future:
        """Queue one command for the sender; its answer resolves the future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None or self._closed:
                fut.set_exception(RuntimeError(self._dead or "the AsyncEngine was shut down"))
                return fut
            call_id = next(self._ids)
            self._futures[call_id] = (fut, devices or set())
            self._outbox.append(Call(call_id, method, args, {}))
            self._lock.notify()
        return fut

    def _engine_call(self, method: str, args: tuple, kwargs: dict) -> concurrent.futures.Future:
        payload, devices = encode_args(method, args, kwargs)
        return self._post(method, payload, devices=devices)

    def _read(self, name: str) -> Any:
        """A property of the engine: a round trip to the child (it answers between two steps)."""
        return self._engine_call(GET, (name,), {}).result()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while not self._outbox and self._dead is None:
                    if self._ack_owed is None:
                        self._lock.wait()
                    elif self._ack_owed[2] <= time.monotonic():
                        self._queue_ack()  # a loop that got outputs has not run them in time
                    else:
                        self._lock.wait(self._ack_owed[2] - time.monotonic())
                batch, self._outbox = self._outbox, []
            if not batch:
                return  # the child is gone
            try:
                self._conn.send(batch)
            except (OSError, ValueError):
                return  # the child is gone; the reader says so
            if any(c.method == CLOSE for c in batch):
                return

    # -- the child's updates ----------------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            try:
                update: Update = self._conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._apply(update)
            except Exception:  # a bug here must not leave every caller hanging
                log.exception("applying an engine update failed")
                break
        self._child_gone()

    def _apply(self, update: Update) -> None:
        items: list[tuple[_Channel, RequestOutput | BaseException]] = []
        with self._lock:
            for out in update.finished:
                ch = self._channels.pop(out.request_id, None)
                if ch is not None:
                    items.append((ch, out))
            for rid, deltas in _by_request(update.tokens).items():
                ch = self._channels.get(rid)
                if ch is not None and ch.text is not None:
                    items.append((ch, deltas))
            if update.failed:
                error = _exception(update.error)
                items += [(ch, error) for rid in update.failed if (ch := self._channels.pop(rid, None))]
            answered = [(self._futures.pop(r.id), r) for r in update.replies]
            self._updates += 1
            number = self._updates
        loops = deliver(items)  # outputs before answers: an abort's caller finds the aborted output queued
        for (fut, devices), reply in answered:
            _resolve(fut, reply, devices)
        self._owe_ack(number, loops)

    # -- acknowledging updates ----------------------------------------------------------------------
    def _owe_ack(self, number: int, loops: list[asyncio.AbstractEventLoop]) -> None:
        """Acknowledge update `number` once every loop in `loops` has run the callers it woke (at once
        when there are none). A later update's ACK stands for the earlier ones too."""
        with self._lock:
            self._ack_owed = (number, len(loops), time.monotonic() + ACK_AFTER_S)
            if not loops:
                self._queue_ack()
            else:
                self._lock.notify()  # the sender waits for the deadline from now on
        for loop in loops:
            try:  # on the loop after the delivery; its call_soon then runs after the callers it woke
                loop.call_soon_threadsafe(lambda loop=loop: loop.call_soon(self._loop_done, number))
            except RuntimeError:  # closed: nothing to wait for there
                self._loop_done(number)

    def _loop_done(self, number: int) -> None:
        with self._lock:
            if self._ack_owed is None or self._ack_owed[0] != number:
                return  # acknowledged already (timed out), or a later update owes it now
            number, left, deadline = self._ack_owed
            self._ack_owed = (number, left - 1, deadline)
            if left == 1:
                self._queue_ack()

    def _queue_ack(self) -> None:
        """(Under the lock.) The sender's next batch carries the ACK."""
        self._ack_owed = None
        self._outbox.append(Call(0, W.ACK, (), {}))
        self._lock.notify()

    def _child_gone(self) -> None:
        """Fail everything pending: the child exited (closed, or died) and nothing more will come."""
        if self._proc is not None:
            self._proc.join(timeout=5)
        with self._lock:
            closing = self._stopping or self._closed
            if closing:
                self._dead = "the AsyncEngine was shut down"
            elif self._proc is None:
                self._dead = "the engine process closed the connection (it stopped, or died)"
            else:
                self._dead = f"the engine process died (exit code {self._proc.exitcode})"
            channels, self._channels = list(self._channels.values()), {}
            futures, self._futures = list(self._futures.values()), {}
            self._lock.notify_all()
        if not closing:
            log.error("%s", self._dead)
        deliver([(ch, RuntimeError(self._dead)) for ch in channels])
        for fut, _ in futures:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(self._dead))

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the child: requests in flight end as aborted (callers get their partial outputs), then
        it shuts its engine down and exits. A child that does not stop within CLOSE_TIMEOUT_S is
        terminated, then killed. An attached front (`attach`) only detaches: its own requests end as
        aborted, the engine goes on. Safe to call twice."""
        with self._count_lock:
            if self._stopping:
                first = False
            else:
                self._stopping = first = True
        if first:
            with self._lock:
                self._outbox.append(Call(0, CLOSE, (), {}))
                self._lock.notify()
            if self._proc is not None:
                reap(self._proc, CLOSE_TIMEOUT_S)
        # an attached front: the worker aborts its requests, sends their outputs, then closes the link
        self._reader.join(None if self._proc is not None else CLOSE_TIMEOUT_S)
        self._sender.join()
        with self._count_lock:
            self._closed = True
        self._finalizer.detach()
        self._conn.close()


def _stop_worker(conn: Any, proc: Any) -> None:
    """The finalizer of a ProcessAsyncEngine never closed (the script exited without close()): ask
    the worker to close, as close() does (the worker reads lists of commands), then reap it."""
    try:
        conn.send([Call(0, CLOSE, (), {})])
    except (OSError, ValueError):
        pass
    reap(proc, CLOSE_TIMEOUT_S)
    conn.close()


def _detach(conn: Any) -> None:
    """An attached front's finalizer: say goodbye to the worker (it aborts that front's requests)."""
    try:
        conn.send([Call(0, CLOSE, (), {})])
    except (OSError, ValueError):
        pass
    conn.close()


def _by_request(deltas: list[TokenDelta]) -> dict[Hashable, list[TokenDelta]]:
    grouped: dict[Hashable, list[TokenDelta]] = {}
    for d in deltas:
        grouped.setdefault(d.request_id, []).append(d)
    return grouped


def _exception(reply: Reply | None) -> BaseException:
    try:
        unwrap(reply)
    except BaseException as e:
        return e
    return RuntimeError("a step failed")


def _resolve(fut: concurrent.futures.Future, reply: Reply, devices: set) -> None:
    if any(d.type == "cuda" for d in devices):
        ipc.release()  # the child dropped its handles: free blocks we no longer hold
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(unwrap(reply))
    except BaseException as e:
        fut.set_exception(e)


def _forward(name: str) -> Any:
    """An Engine method as a coroutine run by the child between steps. With abort=True the requests in
    flight are aborted first, so their callers get their outputs at once."""
    method = getattr(Engine, name)
    sig = inspect.signature(method)

    async def call(self: ProcessAsyncEngine, *args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(None, *args, **kwargs)
        if bound.arguments.get("abort"):
            self._post(W.ABORT_ALL)
            bound.arguments["abort"] = False
        return await asyncio.wrap_future(self._engine_call(name, bound.args[1:], bound.kwargs))

    call.__name__ = call.__qualname__ = name
    call.__doc__ = method.__doc__
    call.__signature__ = sig  # type: ignore[attr-defined]
    return call


def _property(name: str) -> property:
    if name in CONSTANT_PROPERTIES:
        return property(lambda self: self._facts[name], doc=getattr(Engine, name).__doc__)
    return property(lambda self: self._read(name), doc=getattr(Engine, name).__doc__)


for _name in ENGINE_METHODS:
    if _name not in REQUEST_METHODS:
        setattr(ProcessAsyncEngine, _name, _forward(_name))
for _name in ENGINE_PROPERTIES:
    setattr(ProcessAsyncEngine, _name, _property(_name))
