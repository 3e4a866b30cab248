"""`Engine.stats`: a read-only snapshot of the engine's requests, pages, steps and graph replays."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A read-only snapshot of the engine's state (`Engine.stats`)."""

    requests: int  # in flight
    running: int  # sequences on the device
    waiting: int  # sequences queued (preempted ones included)
    pages_total: int
    pages_free: int  # free or held only by the prefix cache
    pages_cached: int  # pages indexed in the prefix cache
    page_size: int
    steps: int  # since the engine started
    prefill_steps: int  # of those steps (the others decode)
    prefill_tokens: int
    decode_tokens: int
    step_seconds: float  # host time inside step(): against the wall time, what the driving loop adds
    preemptions: int
    graph_steps: int  # decode steps replayed from a CUDA graph
    eager_steps: int
    weight_version: int
    released_tags: frozenset[str]
