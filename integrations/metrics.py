"""Per-step metrics of an RL loop: phase timers, a console line, tqdm progress, optional wandb.

wandb is imported only when asked for; it honours WANDB_MODE=offline (the run is written under
`<dir>/wandb/offline-run-*`, to be synced later with `wandb sync`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from tqdm.auto import tqdm


class PhaseTimer:
    """Wall-clock seconds per named phase of one step (generate, train, sync, release, resume...)."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()  # GPU work is asynchronous: wait for it so it counts in its own phase
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def metrics(self) -> dict[str, float]:
        return {f"time/{phase}": s for phase, s in self.seconds.items()}


def device_used_bytes(device: torch.device | str) -> int | None:
    """Bytes in use on a CUDA device (all processes, as the driver sees it); None on other devices."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def rollout_metrics(
    rewards: Sequence[float], lengths: Sequence[int], generate_seconds: float
) -> dict[str, float]:
    """Reward and length statistics of one step's samples, and the engine's output tokens per second."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    n = torch.as_tensor(lengths, dtype=torch.float64)
    return {
        "reward/mean": r.mean().item(),
        "reward/std": r.std(correction=0).item(),
        "reward/solved": (r >= 1).double().mean().item(),  # share of samples with full marks
        "length/mean": n.mean().item(),
        "length/max": n.max().item(),
        "throughput/gen_tokens_per_s": n.sum().item() / max(generate_seconds, 1e-9),
    }


# keys shown on the console line, in order, with their format
CONSOLE = [
    ("reward/mean", "reward {:.3f}"),
    ("reward/std", "±{:.3f}"),
    ("length/mean", "len {:.1f}"),
    ("throughput/gen_tokens_per_s", "{:.0f} tok/s"),
    ("loss/policy", "pg {:+.4f}"),
    ("loss/value", "vf {:.4f}"),
    ("logprob_gap/mean", "gap {:.1e}"),
    ("logprob_gap/max", "max {:.1e}"),
    ("time/generate", "gen {:.2f}s"),
    ("time/train", "train {:.2f}s"),
    ("time/sync", "sync {:.2f}s"),
    ("time/release", "rel {:.2f}s"),
    ("time/resume", "res {:.2f}s"),
    ("memory/released_gb", "freed {:.2f}GB"),
    ("memory/train_peak_gb", "train peak {:.2f}GB"),
]


def console_line(step: int, metrics: dict[str, float], formats: dict[str, str] | None = None) -> str:
    """One step on one line; `formats` overrides CONSOLE's format of some keys (e.g. to name dtypes)."""
    formats = formats or {}
    parts = [f"step {step}"]
    parts += [formats.get(key, fmt).format(metrics[key]) for key, fmt in CONSOLE if key in metrics]
    return " | ".join(parts)


def summary(history: list[dict[str, float]], key: str = "reward/mean") -> str:
    """Mean of `key` over the first and the last fifth of a run, as one line."""
    k = max(1, len(history) // 5)
    first = sum(h[key] for h in history[:k]) / k
    last = sum(h[key] for h in history[-k:]) / k
    steps = "step" if k == 1 else f"{k} steps"
    return f"{key}: first {steps} {first:.3f} -> last {steps} {last:.3f}"


# the per-step breakdown of a run, as a row of docs/benchmarks.md: (metric, column, format)
BENCH_COLUMNS = [
    ("length/mean", "mean len", "{:.0f}"),
    ("throughput/gen_tokens_per_s", "gen tok/s", "{:.0f}"),
    ("time/generate", "generate s", "{:.3f}"),
    ("time/release", "release s", "{:.3f}"),
    ("time/train", "train s", "{:.3f}"),
    ("time/resume", "resume s", "{:.3f}"),
    ("time/sync", "sync s", "{:.3f}"),
    ("memory/train_peak_gb", "train peak GB", "{:.2f}"),
    ("logprob_gap/mean", "gap mean", "{:.1e}"),
    ("logprob_gap/max", "gap max", "{:.1e}"),
]


def benchmark_table(labels: dict[str, str], history: list[dict[str, float]], warmup: int = 1) -> str:
    """A markdown header and one row: `labels` (model, shapes, dtypes...), then each metric's mean over
    the steps after the first `warmup` (the first step pays one-time costs: CUDA graphs, allocator)."""
    steps = history[warmup:] or history
    cells = list(labels.values())
    for key, _, fmt in BENCH_COLUMNS:
        values = [h[key] for h in steps if key in h]
        cells.append(fmt.format(sum(values) / len(values)) if values else "-")
    header = [*labels, *(column for _, column, _ in BENCH_COLUMNS)]
    rows = [header, ["---"] * len(header), cells]
    note = f"means over steps {steps[0]['step']:.0f}-{steps[-1]['step']:.0f}" if "step" in steps[0] else ""
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + (f"\n({note})" if note else "")


class MetricsLogger:
    """Logs one dict of numbers per step to the console (and wandb when enabled), with a progress bar.

    Use as a context manager, or call `close()` at the end so the wandb run is finished.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        use_wandb: bool = False,
        project: str = "rollout",
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        wandb_dir: str | None = None,
        console: bool = True,
        progress: bool = True,
        formats: dict[str, str] | None = None,
    ):
        self.console = console
        self.formats = formats or {}
        self.history: list[dict[str, float]] = []
        self.run = None
        if use_wandb:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("use_wandb needs the wandb package: pip install wandb") from e
            self.run = wandb.init(project=project, name=run_name, config=config or {}, dir=wandb_dir)
        self.bar = tqdm(
            total=total_steps, desc="train", unit="step", disable=not progress, dynamic_ncols=True
        )

    @property
    def run_dir(self) -> str | None:
        """The wandb run's folder (…/wandb/offline-run-*/ when offline), None without wandb."""
        return None if self.run is None else str(self.run.dir).removesuffix("/files")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.history.append({"step": step, **metrics})
        if self.run is not None:
            self.run.log(metrics, step=step)
        if self.console:
            self.bar.write(console_line(step, metrics, self.formats))
        self.bar.set_postfix_str(f"reward {metrics.get('reward/mean', float('nan')):.3f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if self.run is not None:
            self.run.finish()
            self.run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
