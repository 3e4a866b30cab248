"""The step driver: the one loop over `Engine.step` in the package, and the commands run between steps.

Every way of running requests drives the engine through a `StepDriver`: `Engine.generate` (to the
end), `AsyncEngine` (on its loop thread), the engine worker (over its pipe) and the SGLang front's
streaming. Each of them is a `Front` that only receives commands and delivers outputs; the driver owns
what they share:

- the requests in flight and their owners (whatever the front needs to deliver an output: a channel,
  a link to a parent; None for requests added around the driver, as generate's);
- commands between steps: add, abort, abort-all, the three pause modes, Engine methods (weight and
  memory calls, also while paused; with abort=True, the requests in flight are aborted first, so their
  callers get their outputs at once);
- the stalled state: a step that raised leaves the driver idle until the next command (e.g. memory
  released under retracted requests waits for a resume); the requests it ended go to `Front.failed`;
- abort-all on close: callers get the outputs they have.

Pausing has SGLang's three modes:
- "abort": requests in flight end as aborted, with the tokens and logprobs they have;
- "retract": requests leave the device (their pages are freed) and wait; after `resume` they go on from
  their tokens, recomputing their KV with the weights of then;
- "in_place": requests keep their pages and no step runs. Weight updates and memory releases are refused
  while such requests hold KV (their cache would mix two weight versions) unless called with abort=True.

A turn costs the front's `poll` and one `deliver` beside the step: no queue, lock or thread hand-off
of the driver's own (the worker's throughput depends on it; see docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable
from typing import Any, Literal, Protocol

from rollout.outputs import RequestOutput

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")


class Steppable(Protocol):
    """What the driver uses of an Engine (the engine's methods of the same names)."""

    def step(self) -> list[RequestOutput]: ...
    def has_unfinished(self, request_id: Hashable | None = None) -> bool: ...
    def add_request(self, request_id: Hashable, input_ids: Any, sampling_params: Any, **kw: Any) -> None: ...
    def abort_request(self, request_id: Hashable) -> RequestOutput | None: ...
    def retract_requests(self) -> int: ...


class Front(Protocol):
    """What a driver's caller provides: where commands come from and where outputs go."""

    def poll(self, block: bool) -> bool | None:
        """Run the commands waiting (through the driver's command methods); with `block` (the driver is
        idle), wait for one first. True when a command ran, False when none did, None to end the loop."""

    def deliver(self, items: list[tuple[Any, RequestOutput]]) -> None:
        """Outputs of a step or of aborts, each with its request's owner (None: not added through the
        driver). Finished requests have left the driver."""

    def failed(self, error: Exception, ended: list[tuple[Hashable, Any]]) -> None:
        """A step raised `error`; `ended` are the (request id, owner) it aborted. May raise."""


class StepDriver:
    """Drives one Engine; see the module docstring. Not thread-safe: one thread runs it."""

    def __init__(self, engine: Steppable, front: Front):
        self.engine, self.front = engine, front
        self.owners: dict[Hashable, Any] = {}  # requests added through the driver, in flight
        self.paused: PauseMode | None = None
        self.stalled = False  # the last step raised with requests left in flight: wait for a command

    @property
    def idle(self) -> bool:
        """Whether the next turn runs no step (paused, stalled, or nothing in flight)."""
        return self.paused is not None or self.stalled or not self.engine.has_unfinished()

    def run(self) -> None:
        """Turns until the front's `poll` says to end: the commands waiting, then one step unless idle."""
        front, step = self.front, self.step
        while True:
            ran = front.poll(self.idle)
            if ran is None:
                return
            if ran:
                self.stalled = False
            if not self.idle:
                step()

    def step(self) -> None:
        """One `Engine.step`; its outputs go to the front with their owners."""
        try:
            outs = self.engine.step()
        except Exception as e:
            self.stalled = True
            has = self.engine.has_unfinished
            ended = [(rid, owner) for rid, owner in self.owners.items() if not has(rid)]
            for rid, _ in ended:
                del self.owners[rid]
            self.front.failed(e, ended)
            return
        if outs:  # most decode steps of unstreamed requests end none
            owners = self.owners
            self.front.deliver(
                [
                    (owners.pop(o.request_id, None) if o.finished else owners.get(o.request_id), o)
                    for o in outs
                ]
            )

    # -- commands (run between steps, on the driver's thread) -------------------------------------
    def add(
        self,
        request_id: Hashable,
        input_ids: Any,
        params: Any,
        owner: Any,
        *,
        prompt: str | None = None,
        stream: bool = False,
    ) -> None:
        """Add a request; its outputs go to the front with `owner`."""
        if request_id in self.owners:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        self.engine.add_request(request_id, input_ids, params, prompt=prompt, stream=stream)
        self.owners[request_id] = owner

    def abort(self, request_id: Hashable) -> bool:
        """End a request with finish_reason "abort"; its owner gets the output it has. False when no
        such request is in flight."""
        out = self.engine.abort_request(request_id)
        owner = self.owners.pop(request_id, None)
        if out is not None and owner is not None:
            self.front.deliver([(owner, out)])
        return out is not None

    def abort_all(self, owned: Callable[[Any], bool] | None = None) -> int:
        """Abort every request added through the driver (with `owned`, those whose owner it accepts)."""
        return sum(
            self.abort(rid) for rid, owner in list(self.owners.items()) if owned is None or owned(owner)
        )

    def pause(self, mode: PauseMode) -> None:
        """Stop stepping; see the module docstring for the modes."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.paused = mode
        if mode == "abort":
            self.abort_all()
        if mode in ("abort", "retract"):
            # nothing holds KV now: updates and releases may go through with requests queued
            self.engine.retract_requests()

    def resume(self) -> None:
        """Step again; retracted requests recompute their KV and go on."""
        self.paused = None

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        """Run the Engine method `name`. With abort=True the requests in flight are aborted here first
        (their owners get their outputs now) and the method runs with abort=False."""
        method = getattr(type(self.engine), name)
        if "abort" in _parameters(method):
            bound = inspect.signature(method).bind(self.engine, *args, **kwargs)
            if bound.arguments.get("abort"):
                self.abort_all()
                bound.arguments["abort"] = False
            return method(*bound.args, **bound.kwargs)
        return method(self.engine, *args, **kwargs)

    def close(self) -> int:
        """Abort what is in flight (its owners get their outputs); returns how many."""
        return self.abort_all()


@functools.cache
def _parameters(method: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(method).parameters)


class _ToEnd:
    """`run_to_end`'s front: no commands, every output kept, a failed step raised to the caller."""

    def __init__(self, on_output: Callable[[RequestOutput], None] | None):
        self.done: dict[Hashable, RequestOutput] = {}
        self.on_output = on_output

    def poll(self, block: bool) -> bool | None:
        return None if block else False  # idle: nothing left in flight

    def deliver(self, items: list[tuple[Any, RequestOutput]]) -> None:
        for _, out in items:
            self.done[out.request_id] = out
            if self.on_output is not None:
                self.on_output(out)

    def failed(self, error: Exception, ended: list[tuple[Hashable, Any]]) -> None:
        raise error


def run_to_end(
    engine: Steppable, on_output: Callable[[RequestOutput], None] | None = None
) -> dict[Hashable, RequestOutput]:
    """Step until nothing is in flight (`Engine.generate`); each request's last output by its id.
    `on_output` sees every output as it comes. A failed step raises (the caller cleans up)."""
    front = _ToEnd(on_output)
    StepDriver(engine, front).run()
    return front.done
