"""What stands between a request and the handlers (docs/security.md): the Host header, the body size,
the API key. The first two are plain ASGI middleware (no per-request task, as Starlette's
BaseHTTPMiddleware would add); the key is a FastAPI dependency of every route but /health.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi import Request

from rollout.serve.errors import ApiError, body

WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(bind: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The Host names a server bound to `bind` answers (None: any). A browser page that reaches
    127.0.0.1 through DNS rebinding still sends its own name as Host, so a server on a loopback or
    one named address answers only that address (and `extra`: --allowed-hosts). A wildcard bind
    answers any Host unless --allowed-hosts names some; "*" in them turns the check off."""
    extra = {h.strip().lower() for h in extra if h.strip()}
    if "*" in extra:
        return None
    if bind in WILDCARD_BINDS and not extra:
        return None
    names = set(extra)
    if bind not in WILDCARD_BINDS:
        names.add(bind.lower().strip("[]"))
        if _is_loopback(bind):
            names.update(LOOPBACK_NAMES)
    return frozenset(names)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """`Host`'s name without its port: "a.b:80" -> "a.b", "[::1]:80" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    """ASGI middleware: refuse a request whose Host is not allowed (400) or whose body is over its
    path's limit (413, by Content-Length before reading, or while reading a chunked body). `limits`:
    path -> bytes (None: no cap), "" for every other path."""

    def __init__(self, app: Any, hosts: frozenset[str] | None, limits: dict[str, int | None]):
        self.app, self.hosts, self.limits = app, hosts, limits

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = length = None
        for k, v in scope["headers"]:
            if k == b"host":
                host = v.decode("latin-1")
            elif k == b"content-length":
                length = v
        if self.hosts is not None and (host is None or host_name(host) not in self.hosts):
            return await _refuse(
                send, 400, f"Host header {host!r} is not allowed (see --allowed-hosts)", "host"
            )
        cap = self.limits.get(scope["path"], self.limits.get(""))
        if cap is None:
            return await self.app(scope, receive, send)
        if length is not None and (not length.isdigit() or int(length) > cap):
            return await _refuse(send, 413, _too_big(cap), None)
        return await self._counted(scope, receive, send, cap)

    async def _counted(self, scope: dict, receive: Callable, send: Callable, cap: int) -> None:
        """A body without (or with a lying) Content-Length: counted while the app reads it. Past the
        cap the read fails; whatever the app answers to that (FastAPI: a 400 about the body) is
        replaced by the 413."""
        seen, over, replaced = 0, False, False

        async def counting_receive() -> dict:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap:
                    over = True
                    raise _TooBig
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal replaced
            if not over:
                return await send(message)
            if not replaced:
                replaced = True
                await _refuse(send, 413, _too_big(cap), None)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _TooBig:
            if not replaced:
                await _refuse(send, 413, _too_big(cap), None)


class _TooBig(Exception):
    pass


def _too_big(cap: int) -> str:
    return f"the request body is over {cap} bytes (--max-body-bytes / --max-weight-body-bytes)"


async def _refuse(send: Callable, status: int, message: str, param: str | None) -> None:
    payload = json.dumps(body(status, message, param=param)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def api_key_check(api_key: str) -> Callable[[Request], Awaitable[None]]:
    """A dependency: the request carries `Authorization: Bearer <api_key>`, compared in constant
    time (a byte-by-byte compare that stops at the first difference tells, by its timing, how much of
    a guess was right)."""
    want = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        got = request.headers.get("authorization", "").encode("latin-1", "replace")
        if not hmac.compare_digest(got, want):
            raise ApiError(
                401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key"
            )

    return check
