"""Benchmark one GRPO step of examples/grpo.py: where the time goes between generate and train.

    python scripts/bench_rl_step.py --model qwen2.5-0.5b --batch 64 --n 8 --max-new-tokens 1024 \\
        --micro-batch-tokens 16384 --gradient-checkpointing --autocast bf16 --lr 1e-6 --steps 4 [--profile]
    python scripts/bench_rl_step.py --model tiny --steps 3 --device cpu     # seconds, on a CPU

It runs examples/grpo.py's own `train` (random checkpoints of scripts/models.py's shapes, or `tiny`: the
built-in tiny model) and prints each step's phases: generate, release, train, resume, sync, and
*other* (rewards, batching, logging: the rest of the step), then the share of the step outside generate
and train (target: at most 5%). The mean row skips the first step (CUDA graphs, allocator warm-up).
`--profile` runs cProfile during the release, resume and sync phases only and prints their top functions.
Every other flag is examples/grpo.py's.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "examples"))
import grpo  # noqa: E402
from models import SHAPES, bench_model  # noqa: E402

from integrations.metrics import PhaseTimer  # noqa: E402

PHASES = ("generate", "release", "train", "resume", "sync")
COLUMNS = (*PHASES, "other", "step")


class StepTimer(PhaseTimer):
    """grpo.train's PhaseTimer, which also notes when each step starts (one timer a step) and, when
    profiling, runs the profiler inside the phases that are neither generate nor train."""

    starts: list[float] = []
    profiler: cProfile.Profile | None = None

    def __init__(self, device: Any = None):
        super().__init__(device)
        StepTimer.starts.append(time.perf_counter())

    @contextmanager
    def __call__(self, phase: str):
        profile = self.profiler is not None and phase not in ("generate", "train")
        with super().__call__(phase):
            if profile:
                self.profiler.enable()
            try:
                yield
            finally:
                if profile:
                    self.profiler.disable()


def step_rows(history: list[dict[str, float]], starts: list[float], end: float) -> list[dict[str, float]]:
    """Each step's phase seconds, its wall time (start to the next step's start) and the rest."""
    rows = []
    for i, h in enumerate(history):
        row = {p: h.get(f"time/{p}", 0.0) for p in PHASES}
        row["step"] = (starts[i + 1] if i + 1 < len(starts) else end) - starts[i]
        row["other"] = max(0.0, row["step"] - sum(row[p] for p in PHASES))
        rows.append(row)
    return rows


def outside_share(row: dict[str, float]) -> float:
    return 1.0 - (row["generate"] + row["train"]) / row["step"]


def table(rows: list[dict[str, float]]) -> str:
    lines = [
        "| step | " + " | ".join(f"{c} s" for c in COLUMNS) + " | outside generate+train |",
        "|---" * (len(COLUMNS) + 2) + "|",
    ]
    for i, row in enumerate(rows):
        lines.append(_line(str(i), row))
    steady = rows[1:] or rows
    mean = {c: sum(r[c] for r in steady) / len(steady) for c in COLUMNS}
    lines.append(_line(f"mean {'1-' if len(rows) > 1 else '0-'}{len(rows) - 1}", mean))
    return "\n".join(lines)


def _line(label: str, row: dict[str, float]) -> str:
    cells = " | ".join(f"{row[c]:.4f}" for c in COLUMNS)
    return f"| {label} | {cells} | {outside_share(row):.2%} |"


def model_folder(name: str | None) -> str | None:
    """A shape of scripts/models.py as its random checkpoint; `tiny` (or nothing) as grpo's default."""
    if name in (None, "tiny"):
        return None
    return str(bench_model(name)) if name in SHAPES else name


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    profile = "--profile" in argv
    if profile:
        argv.remove("--profile")
    cfg = grpo.parse_args(argv)
    cfg = type(cfg)(**{**vars(cfg), "model": model_folder(cfg.model), "progress": False})
    StepTimer.starts = []
    StepTimer.profiler = cProfile.Profile() if profile else None
    grpo.PhaseTimer = StepTimer  # the loop's timer, noting step starts (and profiling)
    history = grpo.train(cfg)
    rows = step_rows(history, StepTimer.starts, time.perf_counter())
    print(f"\nGRPO step breakdown: {Path(cfg.model or 'tiny').name}, {cfg.batch} prompts x {cfg.n}, "
          f"{cfg.max_new_tokens} new tokens, {cfg.device or 'auto'} device")  # fmt: skip
    print(table(rows))
    if profile:
        out = io.StringIO()
        pstats.Stats(StepTimer.profiler, stream=out).sort_stats("cumulative").print_stats(25)
        print("\nrelease + resume + sync, cumulative time:\n" + out.getvalue())
    return rows


if __name__ == "__main__":
    main()
