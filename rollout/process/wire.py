"""What crosses the pipe between a parent and an engine's child: EngineProcess's calls and answers, and
the engine worker's (rollout/process/worker.py) one update per step."""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from rollout.outputs import RequestOutput, TokenDelta

CLOSE = "__close__"  # stop serving
GET = "__getattr__"  # read a property


@dataclass
class Call:
    id: int
    method: str
    args: tuple
    kwargs: dict


@dataclass
class Reply:
    id: int
    ok: bool
    value: Any  # the result, or the exception
    traceback: str = ""


class RemoteTraceback(Exception):
    """Carries the child's traceback text; set as the cause of an exception re-raised in the parent."""

    def __str__(self) -> str:
        return "\n\nTraceback in the engine process:\n" + self.args[0]


def unwrap(reply: Reply) -> Any:
    """The call's result, or its exception raised here."""
    if reply.ok:
        return reply.value
    raise reply.value from RemoteTraceback(reply.traceback)


def error_reply(call_id: int, e: BaseException) -> Reply:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        pickle.loads(pickle.dumps(e))
        err: BaseException = e
    except Exception:  # an exception that cannot cross keeps its type name and message
        err = RuntimeError(f"{type(e).__name__}: {e}")
    err.__traceback__ = None
    return Reply(call_id, False, err, tb)


@dataclass
class Update:
    """One message of the engine worker per loop turn: the answers to the commands it ran, the whole
    outputs of the requests that ended (finished or aborted), the new tokens of streamed requests that
    go on, and the requests a failed step ended, with its error."""

    replies: list[Reply] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)
    tokens: list[TokenDelta] = field(default_factory=list)
    failed: list[Hashable] = field(default_factory=list)
    error: Reply | None = None

    def __bool__(self) -> bool:
        return bool(self.replies or self.finished or self.tokens or self.failed)

    def __reduce__(self) -> tuple:
        # the deltas cross as plain tuples: they pickle about 5x faster than NamedTuples, and the
        # pickling runs in the engine worker, between its steps
        tokens = [tuple(d) for d in self.tokens]
        return _rebuild_update, (self.replies, self.finished, tokens, self.failed, self.error)


def _rebuild_update(replies: list, finished: list, tokens: list[tuple], failed: list, error: Any) -> Update:
    make = TokenDelta._make
    return Update(replies, finished, [make(t) for t in tokens], failed, error)
