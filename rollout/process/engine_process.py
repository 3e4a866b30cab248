"""EngineProcess: the Engine's API with the engine living in a child process (spawned).

Its methods are generated from the one list of the engine's public methods (rollout/api.py), with
Engine's signatures and docstrings, so the two never drift; `add_request` / `step` cross too. Calls
travel over a pipe (rollout/process/wire.py). Tensors among the arguments travel as handles (CUDA IPC on a
GPU, shared memory on a CPU; see rollout/process/ipc.py), never as pickled bytes; a long list of CPU tensors
crosses as one flattened bucket (one file descriptor, not one per tensor). The child finishes the call,
synchronises its device and drops the tensors it opened before it answers, so once a call has
returned the sender may overwrite or free its buffers. An exception raised in the child, also one
raised while unpickling a call's arguments, is raised again in the parent with its type and message
(the child's traceback attached as its cause) and the child keeps serving.

`submit` sends a call without waiting, so a sender can prepare the next buffer while the engine
copies the previous one; answers come back in order.
"""

from __future__ import annotations

import inspect
import itertools
import multiprocessing as mp
import pickle
import weakref
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from rollout.api import BUCKETED_TENSOR_ARGS, CONSTANT_PROPERTIES, ENGINE_METHODS, ENGINE_PROPERTIES
from rollout.engine.engine import Engine
from rollout.process import ipc
from rollout.process.child import serve_child, stop_child
from rollout.process.wire import CLOSE, GET, Call, RemoteTraceback, Reply, error_reply, unwrap
from rollout.weights.bucket import empty_buffer, pack

__all__ = [
    "EngineProcess",
    "PendingCall",
    "RemoteTraceback",
    "encode_args",
    "handle_call",
    "serve_calls",
]

BUCKET_FROM = 32  # CPU tensor lists at least this long cross as one bucket


class PendingCall:
    """A call sent to the engine process; `result()` waits for its answer (raising the child's error)."""

    def __init__(self, owner: EngineProcess, call_id: int, devices: set):
        self._owner, self.id, self._devices = owner, call_id, devices

    def result(self) -> Any:
        return self._owner._wait(self)


class EngineProcess:
    """Same arguments and methods as Engine; the engine runs in a spawned child process. One thread
    at a time may use it (calls share one pipe)."""

    # the methods and properties of rollout.api are attached below the class

    def __init__(self, model: str | Path, *, start_timeout: float = 900.0, **options: Any):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, str(model), options), name="rollout-engine")
        self._proc.start()
        child.close()
        self._ids = itertools.count(1)
        self._pending: list[PendingCall] = []
        self._done: dict[int, Reply] = {}
        self._closed = False
        self._finalizer = weakref.finalize(self, stop_child, self._conn, self._proc)
        if not self._conn.poll(start_timeout):
            self.close()
            raise TimeoutError(f"the engine process did not start within {start_timeout:g}s")
        try:
            self.info = unwrap(self._recv())
        except BaseException:
            self.close()
            raise

    # -- calls ------------------------------------------------------------------------------------
    def submit(self, method: str, *args: Any, **kwargs: Any) -> PendingCall:
        """Send `engine.method(*args, **kwargs)` without waiting for it."""
        if self._closed:
            raise RuntimeError("the engine process is closed")
        payload, devices = encode_args(method, args, kwargs)
        call_id = next(self._ids)
        try:
            self._conn.send(Call(call_id, method, (payload,), {}))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._proc.join(timeout=5)
            self._closed = True
            raise RuntimeError(f"the engine process died (exit code {self._proc.exitcode})") from None
        call = PendingCall(self, call_id, devices)
        self._pending.append(call)
        return call

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.submit(method, *args, **kwargs).result()

    def _wait(self, call: PendingCall) -> Any:
        self._read_until(call.id)
        reply = self._done.pop(call.id)
        self._pending = [p for p in self._pending if p.id != call.id]
        if any(d.type == "cuda" for d in call._devices):
            ipc.release()  # the child dropped its handles: free blocks we no longer hold
        return unwrap(reply)

    def _read_until(self, call_id: int) -> None:
        """Read answers (they come in order) until `call_id`'s has arrived."""
        while call_id not in self._done:
            reply = self._recv()
            self._done[reply.id] = reply

    def _recv(self) -> Reply:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(timeout=5)
            self._closed = True
            raise RuntimeError(f"the engine process died (exit code {self._proc.exitcode})") from None

    # -- lifetime ---------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        """The child's exit status once it has ended (None while it runs)."""
        return self._proc.exitcode

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child: pending calls are answered first, then it shuts its engine down and exits.
        A child that does not stop within `timeout` is terminated, then killed; it is always reaped.
        Safe to call twice."""
        if self._closed:
            return
        try:
            if self._pending:
                self._read_until(self._pending[-1].id)  # their results stay available
        except RuntimeError:
            pass  # the child died; _recv said so
        self._closed = True
        self._finalizer.detach()
        stop_child(self._conn, self._proc, timeout)

    def shutdown(self) -> None:
        """Engine.shutdown: here it stops the child process (see close)."""
        self.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def encode_args(method: str, args: tuple, kwargs: dict) -> tuple[bytes, set]:
    """A call's arguments pickled once, tensors as handles (see rollout/process/ipc.py); also the devices of
    those tensors (the caller runs `ipc.release()` after the answer when one is a GPU)."""
    devices: set = set()
    if method in BUCKETED_TENSOR_ARGS:
        args, kwargs = _cpu_list_as_bucket(method, args, kwargs)
    payload = ForkingPickler.dumps((ipc.to_handles(args, devices), ipc.to_handles(kwargs, devices)))
    ipc.ready_for_peer(devices)
    return bytes(payload), devices


def _cpu_list_as_bucket(method: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A long list of CPU tensors (rollout.api.BUCKETED_TENSOR_ARGS) as one shared-memory bucket: each
    shared tensor would hold a file descriptor until the child is done, and hundreds reach the fd limit."""
    pairs, format_arg = BUCKETED_TENSOR_ARGS[method]
    try:
        bound = inspect.signature(getattr(Engine, method)).bind(None, *args, **kwargs)
    except TypeError:
        return args, kwargs  # the child raises the real error
    named, fmt = bound.arguments.get(pairs), bound.arguments.get(format_arg)
    if isinstance(named, dict):
        named = list(named.items())
    if fmt is not None or not isinstance(named, (list, tuple)) or len(named) < BUCKET_FROM:
        return args, kwargs
    ok = all(
        isinstance(item, (list, tuple))
        and len(item) == 2
        and isinstance(item[0], str)
        and _plain_cpu(item[1])
        for item in named
    )
    if not ok:
        return args, kwargs
    size = sum(t.numel() * t.element_size() for _, t in named)
    bucket = pack(list(named), out=empty_buffer(size, shared=True))
    bound.arguments[pairs], bound.arguments[format_arg] = bucket, "flattened_bucket"
    return bound.args[1:], bound.kwargs


def _plain_cpu(t: Any) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided


def _forward(name: str) -> Any:
    def method(self: EngineProcess, *args: Any, **kwargs: Any) -> Any:
        return self.call(name, *args, **kwargs)

    engine_method = getattr(Engine, name)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = engine_method.__doc__
    method.__signature__ = inspect.signature(engine_method)  # type: ignore[attr-defined]
    return method


def _read(name: str) -> property:
    if name in CONSTANT_PROPERTIES:  # sent with the start-up facts
        return property(lambda self: self.info[name], doc=getattr(Engine, name).__doc__)
    return property(lambda self: self.call(GET, name), doc=getattr(Engine, name).__doc__)


for _name in ENGINE_METHODS:
    if _name != "shutdown":
        setattr(EngineProcess, _name, _forward(_name))
for _name in ENGINE_PROPERTIES:
    setattr(EngineProcess, _name, _read(_name))


# -- the child ------------------------------------------------------------------------------------
def _serve(conn: Any, model: str, options: dict) -> None:
    serve_child(conn, model, options, serve_calls)


def serve_calls(conn: Any, engine: Any) -> None:
    while True:
        try:
            req: Call = conn.recv()
        except (EOFError, OSError):
            return  # the parent went away
        if req.method == CLOSE:
            return
        reply = handle_call(engine, req)
        try:
            conn.send(reply)
        except Exception as e:  # an answer that cannot be pickled becomes an error (nothing was written)
            conn.send(error_reply(req.id, e))


def handle_call(engine: Any, req: Call, invoke: Callable[[str, tuple, dict], Any] | None = None) -> Reply:
    """Run one Engine method or property read; errors become an error reply. `invoke(name, args,
    kwargs)` runs the method where given (the engine worker's step driver), else it is called here."""
    try:
        # unpickled here, not by recv(): arguments that cannot be rebuilt fail this call only
        args, kwargs = pickle.loads(req.args[0])
        req.args = ()
        if req.method == GET:
            if args[0] not in ENGINE_PROPERTIES:
                raise AttributeError(f"Engine.{args[0]} is not a property of the API")
            return Reply(req.id, True, getattr(engine, args[0]))
        if req.method not in ENGINE_METHODS:
            raise AttributeError(f"Engine.{req.method} is not part of the API")
        args, kwargs = ipc.open_handles(args), ipc.open_handles(kwargs)
        if invoke is None:
            value = getattr(engine, req.method)(*args, **kwargs)
        else:
            value = invoke(req.method, args, kwargs)
        del args, kwargs  # drop the opened tensors before answering, so the sender may free them
        if engine.device.type == "cuda":
            import torch

            torch.cuda.synchronize(engine.device)  # every copy out of the sender's memory is done
        return Reply(req.id, True, _to_cpu(value))
    except BaseException as e:
        return error_reply(req.id, e)


def _to_cpu(value: Any) -> Any:
    """Results leave as CPU tensors: a CUDA tensor would hand the parent a handle into our memory."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_to_cpu(v) for v in value)
    return value
