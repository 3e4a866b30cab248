"""A child process's lifecycle: start an Engine in it and report its facts, serve, stop and reap it.

Shared by EngineProcess (calls one at a time) and the engine worker (the step loop over a pipe).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

from rollout.api import CONSTANT_PROPERTIES
from rollout.process.wire import CLOSE, Call, Reply, error_reply

KILL_GRACE_S = 3.0  # after terminate(), how long a child gets before it is killed


def serve_child(conn: Any, model: str, options: dict, loop: Callable[[Any, Any], None]) -> None:
    """A spawned child's body: build the Engine, send its facts (or the start-up error), run
    `loop(conn, engine)`, shut the engine down."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    try:
        from rollout.engine.engine import Engine

        engine = Engine(model, **options)
    except BaseException as e:  # report start-up errors (a bad path, a bad option) to the parent
        conn.send(error_reply(0, e))
        conn.close()
        return
    freeze_heap()
    conn.send(Reply(0, True, engine_facts(engine)))
    try:
        loop(conn, engine)
    finally:
        engine.shutdown()
        conn.close()
        gc.unfreeze()


def freeze_heap() -> None:
    """Move what start-up built (modules, the model, the app) out of the collector's sight, in a process
    of ours about to serve. Otherwise each full collection walks those few hundred thousand objects:
    a 50-200 ms pause of the step loop or the event loop, which a burst of requests sets off. The
    process unfreezes them once it stops serving, so that they are finalised at its exit (else
    extension modules report them as leaked)."""
    gc.collect()
    gc.freeze()


def engine_facts(engine: Any) -> dict:
    """What a child tells its parent about the engine it built, once, after start-up."""
    return {
        "pid": os.getpid(),
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "model_path": str(engine.config.model),
        "tp_rank": engine.tp.rank,
        **{name: getattr(engine, name) for name in CONSTANT_PROPERTIES},
    }


def stop_child(conn: Any, proc: Any, timeout: float = 30.0) -> None:
    """Ask a child serving over `conn` to close, then reap it (see `reap`); `conn` is closed after."""
    try:
        conn.send(Call(0, CLOSE, (), {}))
    except (OSError, ValueError):
        pass
    reap(proc, timeout)
    conn.close()


def reap(proc: Any, timeout: float) -> None:
    """Wait `timeout` for a child asked to stop, then terminate it, then kill it; it is always reaped."""
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(KILL_GRACE_S)
    if proc.is_alive():
        proc.kill()
        proc.join(KILL_GRACE_S)
