"""The engine's lock: every public method runs under it, so calls from several threads are serialised,
never interleaved with a step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def serialised(fn: F | None = None, *, keeps_step_in_flight: bool = False) -> Any:
    """Run a public method under the engine's lock (re-entrant: generate calls step). Unless it
    `keeps_step_in_flight`, the step in flight is collected first: what the method reads or changes
    (weights, memory, adapters, requests' tokens) is then the state after every step launched."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"{fn.__name__}: the engine was shut down")
                if not keeps_step_in_flight:
                    self.pipeline.collect_in_flight()
                return fn(self, *args, **kwargs)

        return locked  # type: ignore[return-value]

    return wrap(fn) if fn is not None else wrap
