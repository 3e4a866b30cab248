"""Prompts to token ids, off the event loop, with errors naming the client's field.

The event loop serves every client: tokenising a 4M-character prompt on it took 3.7 s, during which
/health and every stream waited. Text that is not short is encoded in a worker thread (the tokenizers
library releases the interpreter lock while it works), as is a chat template's rendering.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from rollout.serve.errors import ApiError

T = TypeVar("T")
INLINE_CHARS = 2048  # shorter text is encoded on the loop: a thread hop costs more than the work


async def encode(tok: Any, texts: list[str], field: str) -> list[list[int]]:
    """Each text's token ids, as the engine would encode it."""
    if tok is None:
        raise ApiError(400, f"{field}: the model has no tokenizer; send token ids", param=field)
    for i, t in enumerate(texts):
        if not t:
            raise ApiError(400, f"{field}{_at(i, texts)}: empty text", param=field)

    def run() -> list[list[int]]:
        return [list(tok.encode(t)) for t in texts]

    if sum(len(t) for t in texts) <= INLINE_CHARS:
        return run()
    return await asyncio.to_thread(run)


def token_lists(prompt: Any, field: str) -> tuple[list[Any], bool]:
    """A prompt field of the unions `str | list[str] | list[int] | list[list[int]]` as a list of
    prompts (each a str or an id list) and whether it was a batch; empty ones are refused."""
    if isinstance(prompt, str):
        return [prompt], False
    if not prompt:
        raise ApiError(400, f"{field}: empty list; send at least one prompt", param=field)
    if isinstance(prompt[0], int):  # validated as one of the union's lists: one token list, all ints
        return [prompt], False
    for i, p in enumerate(prompt):
        if not p:
            raise ApiError(400, f"{field}[{i}]: empty prompt", param=field)
    return list(prompt), True


async def ids_of(tok: Any, prompts: list[Any], field: str) -> list[list[int]]:
    """Token ids for a list of prompts, each text or ids (texts encoded together, off the loop)."""
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(await encode(tok, texts, field)) if texts else iter(())
    return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]


async def off_loop(fn: Callable[..., T], *args: Any, chars: int) -> T:
    """`fn(*args)`, in a worker thread when its input (`chars` long) is not short."""
    if chars <= INLINE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def message_chars(messages: list[dict]) -> int:
    """About how much text a chat template will render and encode."""
    return sum(len(str(m.get("content") or "")) for m in messages)


def _at(i: int, items: list) -> str:
    return f"[{i}]" if len(items) > 1 else ""
