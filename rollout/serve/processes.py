"""Running the app under uvicorn, in one process or in several over one engine.

One server process does the HTTP work (parsing, JSON, SSE framing) of every client in one interpreter,
and under hundreds of streams that work, not the device, sets the pace. With --api-server-count N (the
name vLLM uses), the first process starts the engine process and lets the others attach to it
(ProcessAsyncEngine.listen / attach); all N serve one listening socket, which the kernel shares out
among them. Each process streams the requests it accepted; control endpoints (abort, pause, weights,
memory) act on the one engine from any of them.

SIGTERM or Ctrl-C to the first process: it passes the signal on, every process stops accepting and
drains (up to --graceful-shutdown-s; then what is still open is aborted, so each stream ends with a
finish_reason "abort" chunk and [DONE]), the others detach, then the engine shuts down and all exit 0.
If the engine process dies, every server process stops and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import Any

from rollout.serve.chat import ChatParsers
from rollout.serve.policy import Policy

log = logging.getLogger("rollout")

STOP_GRACE_S = 30.0  # past the graceful drain, how long a server process may take to exit
ABORT_FLUSH_S = 5.0  # after the drain, the aborted requests' last chunks have this long to go out


@dataclass(frozen=True)
class ServeSettings:
    """What every server process needs besides its engine."""

    model_name: str
    api_key: str | None
    max_queued_requests: int | None  # per server process
    graceful_shutdown_s: float
    stream_interval: int = 1
    parsers: ChatParsers = ChatParsers()  # chat completions' tool-call and reasoning parsers
    policy: Policy = field(default_factory=Policy)  # hosts, body caps, bounds, the pickle opt-in


def bind(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """The listening socket every server process accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


def run_app(
    app: Any, settings: ServeSettings, sockets: list[socket.socket], on_exit: Any = None, on_start: Any = None
) -> None:
    """Serve `app` on `sockets` until SIGTERM / SIGINT (`on_exit`: called with the signal first;
    `on_start`: called with the uvicorn server before it starts)."""
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level="warning",
        # uvicorn cancels what is open at its deadline, cutting streams mid-chunk: abort them first (at
        # graceful_shutdown_s), so they end whole, and give their last chunks time to go out
        timeout_graceful_shutdown=settings.graceful_shutdown_s + ABORT_FLUSH_S,
        backlog=4096,
        limit_concurrency=None,
    )
    engine = getattr(app.state, "engine", None)
    server = _server_class(uvicorn, on_exit, engine, settings.graceful_shutdown_s)(config)
    if on_start is not None:
        on_start(server)
    server.run(sockets=sockets)


def start_fronts(
    count: int, address: str, key: bytes, sock: socket.socket, settings: ServeSettings, timeout: float = 600.0
) -> list:
    """`count` more server processes over the engine at `address`, serving `sock`; returns once each
    has attached (a process that fails first fails the start, the others are stopped)."""
    ctx = mp.get_context("spawn")
    procs, waiting = [], {}
    for i in range(count):
        ready, tell = ctx.Pipe(duplex=False)  # a pipe, not a semaphore: no resource-tracker process
        proc = ctx.Process(
            target=_front, args=(address, key, sock, settings, tell), name=f"rollout-api-server-{i + 1}"
        )
        proc.start()
        tell.close()
        procs.append(proc)
        waiting[ready] = proc
    deadline = time.monotonic() + timeout
    try:
        while waiting:
            for ready in connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic())):
                try:
                    ready.recv()
                except EOFError:  # it exited before attaching
                    raise RuntimeError(f"{waiting[ready].name} did not start") from None
                del waiting[ready]
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"{len(waiting)} server processes did not start within {timeout:g}s")
    except BaseException:
        for p in procs:
            p.kill()
            p.join()
        raise
    return procs


def stop_fronts(procs: list, timeout: float) -> None:
    """Wait for the other server processes to drain and exit (they got the signal too), then make
    sure none is left."""
    from rollout.process.child import reap

    for p in procs:
        if p.is_alive():
            p.join(timeout)
        reap(p, 1.0)
        if p.exitcode != 0:
            log.warning("%s exited with status %s", p.name, p.exitcode)


def _front(address: str, key: bytes, sock: socket.socket, settings: ServeSettings, tell: Any) -> None:
    """A spawned server process: attach to the engine, serve until told to stop, detach."""
    from rollout.fronts.async_process import ProcessAsyncEngine
    from rollout.serve.app import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limits = dict(max_queued_requests=settings.max_queued_requests, stream_interval=settings.stream_interval)
    engine = ProcessAsyncEngine.attach(address, key, **limits)
    app = build_app(
        engine,
        model_name=settings.model_name,
        api_key=settings.api_key,
        parsers=settings.parsers,
        policy=settings.policy,
    )
    tell.send(True)
    tell.close()
    watch = EngineWatch(engine)
    run_app(app, settings, [sock], on_start=watch.start)
    if watch.died:
        raise SystemExit(1)


class EngineWatch:
    """Stop serving once the engine process is gone while the server was not stopping (it died, or
    the first server process was killed and its engine with it): a server without an engine must not
    keep taking connections. `died` tells the caller to exit 1, so a supervisor restarts the server;
    until it stops, /health fails and requests get 503."""

    def __init__(self, engine: Any):
        self.engine, self.died = engine, False

    def start(self, server: Any) -> None:
        if not hasattr(self.engine, "wait_closed"):  # the engine in a thread of this process
            return

        def watch() -> None:
            self.engine.wait_closed()
            if not server.should_exit:
                self.died = True
                log.error("the engine process is gone; stopping this server")
                server.should_exit = True

        threading.Thread(target=watch, name="rollout-engine-watch", daemon=True).start()


def _server_class(uvicorn: Any, on_exit: Any, engine: Any = None, drain_s: float = 0.0) -> type:
    class Server(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM after its graceful shutdown, so the process dies of the
        signal; the shutdown was clean, so take the signals here and return (exit status 0). The first
        signal also schedules the abort of every open request `drain_s` later."""

        aborting = False

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if on_exit is not None:
                on_exit(sig)
            if engine is not None and not self.aborting:
                self.aborting = True
                _abort_later(engine, drain_s)
            super().handle_exit(sig, frame)

    return Server


def _abort_later(engine: Any, delay: float) -> None:
    """(In a signal handler, on the event loop's thread.) Abort every request still open `delay` from
    now: each caller then gets its output so far with finish_reason "abort"."""
    loop = asyncio.get_event_loop()

    def abort() -> None:
        task = loop.create_task(engine.abort_all())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a dead engine: nothing to abort

    loop.call_soon_threadsafe(loop.call_later, delay, abort)
