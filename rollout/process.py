"""EngineProcess: the Engine's API with the engine living in a child process (spawned).

Calls travel over a pipe as (method, args). Tensors among the arguments travel as handles (CUDA IPC
on a GPU, shared memory on a CPU; see weights/ipc.py), never as pickled bytes. The child finishes the
call, synchronises its device and drops the tensors it opened before it answers, so once a call has
returned the sender may overwrite or free its buffers. An exception raised in the child is raised
again in the parent with its type and message (the child's traceback is attached as its cause).

`submit` sends a call without waiting, so a sender can prepare the next buffer while the engine
copies the previous one; answers come back in order.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import pickle
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.weights import ipc

CLOSE = "__close__"
GET = "__getattr__"


@dataclass
class _Request:
    id: int
    method: str
    args: tuple
    kwargs: dict


@dataclass
class _Reply:
    id: int
    ok: bool
    value: Any  # the result, or the exception
    traceback: str = ""


class RemoteTraceback(Exception):
    """Carries the child's traceback text; set as the cause of an exception re-raised in the parent."""

    def __str__(self) -> str:
        return "\n\nTraceback in the engine process:\n" + self.args[0]


class PendingCall:
    """A call sent to the engine process; `result()` waits for its answer (raising the child's error)."""

    def __init__(self, owner: EngineProcess, call_id: int, devices: set):
        self._owner, self.id, self._devices = owner, call_id, devices

    def result(self) -> Any:
        return self._owner._wait(self)


class EngineProcess:
    """Same arguments and methods as Engine; the engine runs in a spawned child process. One thread
    at a time may use it (calls share one pipe)."""

    def __init__(self, model: str | Path, *, start_timeout: float = 900.0, **options: Any):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, str(model), options), name="rollout-engine")
        self._proc.start()
        child.close()
        self._ids = itertools.count(1)
        self._pending: list[PendingCall] = []
        self._done: dict[int, _Reply] = {}
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._conn, self._proc)
        if not self._conn.poll(start_timeout):
            self.close()
            raise TimeoutError(f"the engine process did not start within {start_timeout:g}s")
        try:
            self.info = _unwrap(self._recv())
        except BaseException:
            self.close()
            raise

    # -- calls ------------------------------------------------------------------------------------
    def submit(self, method: str, *args: Any, **kwargs: Any) -> PendingCall:
        """Send `engine.method(*args, **kwargs)` without waiting for it."""
        if self._closed:
            raise RuntimeError("the engine process is closed")
        devices: set = set()
        req = _Request(
            next(self._ids), method, ipc.to_handles(args, devices), ipc.to_handles(kwargs, devices)
        )
        ipc.ready_for_peer(devices)
        try:
            self._conn.send(req)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._proc.join(timeout=5)
            self._closed = True
            raise RuntimeError(f"the engine process died (exit code {self._proc.exitcode})") from None
        call = PendingCall(self, req.id, devices)
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
        return _unwrap(reply)

    def _read_until(self, call_id: int) -> None:
        """Read answers (they come in order) until `call_id`'s has arrived."""
        while call_id not in self._done:
            reply = self._recv()
            self._done[reply.id] = reply

    def _recv(self) -> _Reply:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(timeout=5)
            self._closed = True
            raise RuntimeError(f"the engine process died (exit code {self._proc.exitcode})") from None

    # -- the Engine API ---------------------------------------------------------------------------
    def generate(self, prompts=None, sampling_params=None, *, input_ids=None, use_tqdm=None):
        return self.call("generate", prompts, sampling_params, input_ids=input_ids, use_tqdm=use_tqdm)

    def update_weights_from_tensor(self, named_tensors, load_format=None, *, abort=False) -> int:
        return self.call("update_weights_from_tensor", named_tensors, load_format, abort=abort)

    def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend="nccl", **kw
    ) -> None:
        return self.call(
            "init_weights_update_group",
            master_address,
            master_port,
            rank_offset,
            world_size,
            group_name,
            backend,
            **kw,
        )

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format=None, **kw):
        return self.call(
            "update_weights_from_distributed", names, dtypes, shapes, group_name, load_format, **kw
        )

    def destroy_weights_update_group(self, group_name) -> None:
        return self.call("destroy_weights_update_group", group_name)

    def update_weights_from_disk(self, model_path, **kw) -> int:
        return self.call("update_weights_from_disk", str(model_path), **kw)

    def get_weights_by_name(self, name, truncate_size=None):
        return self.call("get_weights_by_name", name, truncate_size)

    def flush_cache(self) -> None:
        return self.call("flush_cache")

    def release_memory_occupation(self, tags=None, **kw):
        return self.call("release_memory_occupation", tags, **kw)

    def resume_memory_occupation(self, tags=None, **kw):
        return self.call("resume_memory_occupation", tags, **kw)

    @property
    def weight_version(self) -> int:
        return self.call(GET, "weight_version")

    # -- lifetime ---------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (pending calls are answered first); safe to call twice."""
        if self._closed:
            return
        try:
            if self._pending:
                self._read_until(self._pending[-1].id)  # their results stay available
        except RuntimeError:
            pass  # the child died; _recv said so
        self._closed = True
        self._finalizer.detach()
        _shutdown(self._conn, self._proc, timeout)

    shutdown = close

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _unwrap(reply: _Reply) -> Any:
    if reply.ok:
        return reply.value
    raise reply.value from RemoteTraceback(reply.traceback)


def _shutdown(conn: Any, proc: Any, timeout: float = 30.0) -> None:
    try:
        conn.send(_Request(0, CLOSE, (), {}))
    except (OSError, ValueError):
        pass
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    conn.close()


# -- the child ------------------------------------------------------------------------------------
def _serve(conn: Any, model: str, options: dict) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    try:
        from rollout.engine import Engine

        engine = Engine(model, **options)
    except BaseException as e:  # report start-up errors (a bad path, a bad option) to the parent
        conn.send(_error_reply(0, e))
        conn.close()
        return
    conn.send(_Reply(0, True, {"device": str(engine.device), "dtype": str(engine.dtype)}))
    while True:
        try:
            req: _Request = conn.recv()
        except (EOFError, OSError):
            return  # the parent went away
        if req.method == CLOSE:
            conn.close()
            return
        reply = _handle(engine, req)
        try:
            conn.send(reply)
        except Exception as e:  # an answer that cannot be pickled becomes an error (nothing was written)
            conn.send(_error_reply(req.id, e))


def _handle(engine: Any, req: _Request) -> _Reply:
    try:
        if req.method == GET:
            return _Reply(req.id, True, getattr(engine, req.args[0]))
        if req.method.startswith("_"):
            raise AttributeError(f"Engine.{req.method} is not part of the API")
        fn = getattr(engine, req.method)
        args, kwargs = ipc.open_handles(req.args), ipc.open_handles(req.kwargs)
        req.args = req.kwargs = None
        value = fn(*args, **kwargs)
        del args, kwargs  # drop the opened tensors before answering, so the sender may free them
        if engine.device.type == "cuda":
            import torch

            torch.cuda.synchronize(engine.device)  # every copy out of the sender's memory is done
        return _Reply(req.id, True, _to_cpu(value))
    except BaseException as e:
        return _error_reply(req.id, e)


def _to_cpu(value: Any) -> Any:
    """Results leave as CPU tensors: a CUDA tensor would hand the parent a handle into our memory."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _error_reply(call_id: int, e: BaseException) -> _Reply:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        pickle.loads(pickle.dumps(e))
        err: BaseException = e
    except Exception:  # an exception that cannot cross keeps its type name and message
        err = RuntimeError(f"{type(e).__name__}: {e}")
    err.__traceback__ = None
    return _Reply(call_id, False, err, tb)
