"""EngineProcess's wire protocol: what crosses the pipe between the parent and the engine's child."""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass
from typing import Any

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
