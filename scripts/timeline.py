"""An engine's progress over one run, sampled from its stats by a thread: when its prefill ended, how its
step rate and time inside the steps went, how many requests ran and waited. bench_serve prints one
for Engine.generate and one for each served run (`--timeline`), so the two can be read side by side."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

FIELDS = ("steps", "prefill_steps", "running", "waiting", "step_seconds")


class Timeline:
    """`with Timeline(read) as t:` samples `read()` (an EngineStats) every `every` seconds until the
    block ends; `t.table()` is a sample each `step` seconds (monotonic clock, from the block's start or
    `origin`)."""

    def __init__(self, read: Callable[[], Any], every: float = 0.025):
        self.read, self.every = read, every
        self.rows: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-timeline", daemon=True)

    def __enter__(self) -> Timeline:
        self._t0, self._first = time.monotonic(), self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.rows.append((time.monotonic(), self._sample()))

    def _sample(self) -> dict[str, float]:
        return _fields(self.read())

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.rows.append((time.monotonic(), self._sample()))

    def table(self, origin: float | None = None, base: Any = None, step: float = 0.1) -> str:
        """One line each `step` seconds from `origin` (default: the block's start) until the engine went
        idle: steps, prefill steps and seconds inside the steps since then (counted from `base`, the
        stats read at `origin`; default: the block's start), and the requests running and waiting."""
        origin = self._t0 if origin is None else origin
        base = self._first if base is None else _fields(base)
        rows = [(t - origin, row) for t, row in self.rows if t > origin]
        while len(rows) > 1 and rows[-2][1]["steps"] == rows[-1][1]["steps"]:
            rows.pop()  # idle at the end (the clients exiting)
        lines, mark = ["    t s | steps | prefill | inside s | running | waiting"], step
        for i, (t, row) in enumerate(rows):
            if t < mark and i < len(rows) - 1:
                continue
            d = {k: row[k] - base[k] for k in ("steps", "prefill_steps", "step_seconds")}
            lines.append(
                f"  {t:5.2f} | {d['steps']:5d} | {d['prefill_steps']:7d} | {d['step_seconds']:8.3f} | "
                f"{row['running']:7d} | {row['waiting']:7d}"
            )
            while mark <= t:
                mark += step
        return "\n".join(lines)


def _fields(stats: Any) -> dict[str, float]:
    return {k: getattr(stats, k) for k in FIELDS}
