"""Prompts to token ids, off the event loop, with errors naming the client's field.

The event loop serves every client: tokenising a 4M-character prompt on it took 3.7 s, during which
/health and every stream waited. Text that is not short is encoded in a worker thread (the tokenizers
library releases the interpreter lock while it works), as is a chat template.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollout.serve.errors import ApiError

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


async def chat_ids(tok: Any, messages: list[dict], tools: Any, **template_kwargs: Any) -> list[int]:
    """The chat template's token ids; a template that refuses the messages is a 400 naming them."""
    if tok is None or not getattr(tok, "chat_template", None):
        raise ApiError(
            400, "messages: the model's tokenizer has no chat template; use /v1/completions", param="messages"
        )

    def run() -> list[int]:
        ids = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, **template_kwargs
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    try:
        if sum(len(str(m.get("content", ""))) for m in messages) <= INLINE_CHARS:
            return run()
        return await asyncio.to_thread(run)
    except ApiError:
        raise
    except Exception as e:  # jinja2's TemplateError (raise_exception in a template), a bad message shape
        from jinja2 import TemplateError

        if isinstance(e, (TemplateError, ValueError, TypeError, KeyError, IndexError)):
            raise ApiError(400, f"messages: the chat template refused them: {e}", param="messages") from None
        raise


def _at(i: int, items: list) -> str:
    return f"[{i}]" if len(items) > 1 else ""
