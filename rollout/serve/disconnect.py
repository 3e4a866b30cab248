"""Abort a non-streamed request whose client went away.

A stream notices a gone client when it next writes; a non-streamed request writes only at the end, so
without a watch it generated to the end for nobody. Here the handler's work races the client's
`http.disconnect`; if the client leaves first, the work is cancelled, and cancelling a generate
aborts its requests in the engine (AsyncFront frees their pages).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the answer; nothing is sent."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read already: what comes next is the end)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
