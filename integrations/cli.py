"""The command line the RL examples share: the loop's common flags, and a main that runs and summarises."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from integrations.metrics import summary
from integrations.rl import AUTOCAST
from integrations.tasks import TASKS
from rollout.usage import die, mistake


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each flag's default in --help."""


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def cpu_threads(cfg: Any) -> int | None:
    """The torch CPU thread count to set (None: leave torch's). The built-in model's matrices are
    64-128 wide: on two threads each op pays a hand-off larger than its work (4 GRPO steps on a loaded
    2-core machine: 39 s and 19.6 s of CPU on 2 threads, 13 s and 8.0 s on one; docs/rl.md)."""
    threads = getattr(cfg, "threads", None)
    if threads is not None:
        return threads
    device = getattr(cfg, "device", None)
    on_cpu = device == "cpu" or (device is None and not torch.cuda.is_available())
    return 1 if on_cpu and getattr(cfg, "model", None) is None else None


def loop_parser(defaults: Any, doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the flags every loop takes; `defaults` is the example's Config()."""
    d = defaults
    ap = argparse.ArgumentParser(description=doc, formatter_class=_Formatter)
    ap.add_argument(
        "--model",
        default=None,
        help="HF checkpoint folder (default: the built-in tiny model); one without tokenizer files, such "
        "as the random real-shaped ones of scripts/models.py, gets the built-in character tokenizer",
    )
    ap.add_argument("--task", default=d.task, choices=sorted(TASKS))
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch", type=int, default=d.batch, help="prompts per step")
    ap.add_argument("--n", type=int, default=d.n, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--temperature", type=float, default=d.temperature)
    ap.add_argument("--clip-eps", type=float, default=d.clip_eps)
    ap.add_argument("--epochs", type=int, default=d.epochs, help="passes over each step's rollouts")
    ap.add_argument("--minibatches", type=int, default=d.minibatches, help="optimizer steps per pass")
    ap.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=d.micro_batch_tokens,
        help="padded tokens per trainer forward; gradients accumulate, so the optimizer steps stay "
        "--minibatches (default: one forward per minibatch)",
    )
    ap.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=d.gradient_checkpointing,
        help="recompute each decoder layer in the backward (less activation memory, a slower update)",
    )
    ap.add_argument(
        "--autocast",
        default=d.autocast,
        choices=sorted(AUTOCAST),
        help="the trainer's forward: none (float32) or bf16 autocast; its weights and optimizer stay float32",
    )
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch's CPU threads (default: 1 for the built-in model on a CPU, where its small matrices "
        "run several times faster on one thread than on two; torch's own default otherwise)",
    )
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    ap.add_argument("--dtype", default=d.dtype, help="engine dtype: auto, float32, bfloat16, float16")
    ap.add_argument("--mem-fraction", type=float, default=d.mem_fraction, help="engine's share of the GPU")
    ap.add_argument(
        "--memory-saver",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="free the engine's GPU memory on release (default: on for CUDA with torch_memory_saver)",
    )
    ap.add_argument("--wandb", action="store_true", help="log to wandb (works with WANDB_MODE=offline)")
    ap.add_argument("--wandb-dir", default=None, help="folder for wandb's files (default: ./wandb)")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    return ap


def parsed(parse: Callable[[list[str] | None], Any], argv: list[str] | None) -> Any:
    """The example's Config from the command line; a value the Config refuses is a usage mistake: one
    line naming it, exit status 2 (no traceback)."""
    try:
        return parse(argv)
    except ValueError as e:
        die(Path(sys.argv[0]).name, str(e))


def run_example(train: Callable[[Any], list[dict[str, float]]], cfg: Any) -> list[dict[str, float]]:
    """Train with `cfg`, then print the reward summary and the wall time."""
    wrong = mistake(getattr(cfg, "model", None), getattr(cfg, "device", None))
    if wrong:
        die(sys.argv[0], wrong)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("rollout.memory").setLevel(logging.WARNING)  # each step's line has its timings
    threads = cpu_threads(cfg)
    if threads is not None:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    history = train(cfg)
    print(f"{summary(history)} in {time.perf_counter() - t0:.0f}s")
    return history
