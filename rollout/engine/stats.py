"""`Engine.stats`: a read-only snapshot of the engine's requests, pages, steps and graph replays."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


def engine_stats(engine: Any) -> EngineStats:
    """`engine.stats`: read from its scheduler, pages, pipeline, runner and managers."""
    sched, pages = engine.scheduler, engine.pages
    return EngineStats(
        requests=len(sched.requests),
        running=len(sched.running),
        waiting=len(sched.waiting),
        pages_total=pages.num_pages,
        pages_free=pages.available(),
        pages_cached=len(pages.index),
        page_size=pages.page_size,
        **engine.pipeline.totals,
        preemptions=sched.num_preemptions,
        graph_steps=engine.runner.graph_steps,
        eager_steps=engine.runner.eager_steps,
        weight_version=engine.weights.version,
        released_tags=engine.memory.released,
    )
