"""The plumbing every colocated RL loop repeats: set-up, rollouts with rewards, release, then the
staged refresh and the step's metrics. The examples keep only their update rule.

The loop's edges fail early and say what to change: a task the tokenizer cannot encode, a batch that
does not split into the minibatches, a trainer that cannot fit beside the engine (checked before the
first step where it can be, and a CUDA out-of-memory error in the update is re-raised with advice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from integrations.metrics import (
    MetricsLogger,
    PhaseTimer,
    benchmark_table,
    device_used_bytes,
    rollout_metrics,
)
from integrations.rl import AUTOCAST, RolloutBatch, refresh_engine, rollout_batch, use_memory_saver
from integrations.tasks import TASKS, Problem, Task, char_tokenizer
from rollout import Engine, SamplingParams
from rollout.models.toy import default_model_dir

PROMPT_PROBE = 64  # problems whose prompts are encoded before the first step
ADAMW_BYTES_PER_PARAM = 12  # float32 gradient and AdamW's two moments, beside the float32 weights


class TrainerMemoryError(RuntimeError):
    """The trainer does not fit on the device beside the engine; the message says what to change."""


# -- checks before work starts --------------------------------------------------------------------------
def check_loop_config(cfg: Any, positive: Sequence[str] = ("lr", "temperature", "clip_eps")) -> None:
    """The checks every example's Config shares (cfg: task, steps, batch, n, max_new_tokens, epochs,
    minibatches, micro_batch_tokens, autocast and the floats named in `positive`)."""
    if cfg.task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {cfg.task!r}")
    for name in ("steps", "batch", "n", "max_new_tokens", "epochs", "minibatches"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    check_minibatches(cfg.batch * cfg.n, cfg.minibatches)
    if cfg.micro_batch_tokens is not None and cfg.micro_batch_tokens < 1:
        raise ValueError(
            f"micro_batch_tokens must be >= 1 (or None: whole minibatches), got {cfg.micro_batch_tokens}"
        )
    if cfg.autocast not in AUTOCAST:
        raise ValueError(f"autocast must be one of {sorted(AUTOCAST)}, got {cfg.autocast!r}")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {getattr(cfg, name)}")


def check_minibatches(samples: int, minibatches: int) -> None:
    """Each optimizer step takes an equal share of the step's samples: say which counts would."""
    if samples % minibatches:
        fits = [d for d in range(1, samples + 1) if samples % d == 0][:8]
        raise ValueError(
            f"batch * n = {samples} samples do not split evenly into minibatches={minibatches}: "
            f"use --minibatches in {fits}{' ...' if len(fits) == 8 else ''}, or change --batch / --n; "
            "to bound the trainer's memory, lower --micro-batch-tokens instead (it keeps the optimizer steps)"
        )


def encode_prompts(tokenizer: Any, problems: Sequence[Problem], task: str) -> list[list[int]]:
    """The problems' prompts as token ids; a prompt that encodes to nothing is the tokenizer's gap."""
    ids = [tokenizer.encode(p.prompt) for p in problems]
    for p, tokens in zip(problems, ids):
        if not tokens:
            raise ValueError(
                f"the tokenizer ({type(tokenizer).__name__}) turns the {task!r} task's prompt {p.prompt!r} "
                "into no tokens: it does not know the task's characters. Use another --task, or a "
                "checkpoint whose tokenizer covers them (one without tokenizer files gets the built-in "
                "character tokenizer)"
            )
    return ids


def check_trainer_fits(num_params: int, free_bytes: int, releasable_bytes: int) -> None:
    """The optimizer state the first step allocates must fit in what is free during the update."""
    need = ADAMW_BYTES_PER_PARAM * num_params
    if need > free_bytes + releasable_bytes:
        raise TrainerMemoryError(
            f"the trainer needs at least {need / 2**30:.1f} GiB for float32 gradients and AdamW state "
            f"({num_params / 1e9:.2f}B parameters, activations not counted), but only "
            f"{free_bytes / 2**30:.1f} GiB are free and {releasable_bytes / 2**30:.1f} GiB more come back "
            "when the engine releases: lower --mem-fraction, use --memory-saver "
            "(pip install torch-memory-saver), or train a smaller model"
        )


def oom_advice(cfg: Any) -> str:
    """What to change after the update ran out of device memory, given the flags it ran with."""
    tips = [f"lower --micro-batch-tokens (now {cfg.micro_batch_tokens or 'whole minibatches'})"]
    if not cfg.gradient_checkpointing:
        tips.append("enable --gradient-checkpointing")
    if cfg.autocast == "none":
        tips.append("use --autocast bf16")
    tips.append(f"lower --mem-fraction (now {cfg.mem_fraction}, the engine's share)")
    if not cfg.memory_saver:
        tips.append("use --memory-saver so the engine frees its memory during the update")
    return "the trainer ran out of device memory in the update: " + ", ".join(tips)


# -- the loop ---------------------------------------------------------------------------------------------
@dataclass
class Rollouts:
    """One step's samples as training tensors, their rewards (request-major) and what release freed."""

    batch: RolloutBatch
    rewards: list[float]
    freed_bytes: int | None  # device memory the release gave back (None off CUDA)


@dataclass
class ColocatedLoop:
    """An engine and a float32 transformers policy on one device, a task, and the step logger.

    `cfg` is an example's Config: model, task, seed, batch, n, temperature, max_new_tokens, device, dtype,
    mem_fraction, memory_saver, micro_batch_tokens, gradient_checkpointing, autocast, steps, wandb,
    wandb_dir, progress.
    """

    engine: Engine
    policy: nn.Module
    tokenizer: Any
    task: Task
    params: SamplingParams
    logger: MetricsLogger
    cfg: Any
    labels: dict[str, str] = field(default_factory=dict)  # what a benchmark row names the run by
    train_peak_bytes: int | None = None

    @classmethod
    def build(cls, cfg: Any, project: str) -> ColocatedLoop:
        model_dir = str(cfg.model or default_model_dir())
        saver = use_memory_saver(cfg.memory_saver, cfg.device)
        cfg = dataclasses.replace(cfg, memory_saver=saver)
        engine = Engine(
            model_dir,
            device=cfg.device,
            dtype=cfg.dtype,
            seed=cfg.seed,
            mem_fraction=cfg.mem_fraction,
            enable_memory_saver=saver,
        )
        tokenizer = engine.tokenizer or char_tokenizer()  # random real-shaped checkpoints ship none
        encode_prompts(tokenizer, Task(cfg.task, seed=cfg.seed).sample(PROMPT_PROBE), cfg.task)
        # float32 master weights; eval() turns dropout off, so the ratio compares one function, not two draws
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(engine.device).eval()
        if engine.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(engine.device)
            check_trainer_fits(policy.num_parameters(), free, int(cfg.mem_fraction * total) if saver else 0)
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(policy)
        params = SamplingParams(
            n=cfg.n, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, logprobs=True
        )
        engine_dtype = str(engine.dtype).removeprefix("torch.")
        trainer = "float32" if cfg.autocast == "none" else f"float32+{cfg.autocast} autocast"
        logger = MetricsLogger(
            cfg.steps,
            use_wandb=cfg.wandb,
            project=project,
            config=dataclasses.asdict(cfg),
            wandb_dir=cfg.wandb_dir,
            progress=cfg.progress,
            formats={"logprob_gap/mean": f"gap {engine_dtype} engine vs {trainer} trainer {{:.1e}}"},
        )
        labels = {
            "model": Path(model_dir).name,
            "prompts x n": f"{cfg.batch}x{cfg.n}",
            "max new": str(cfg.max_new_tokens),
            "engine": engine_dtype,
            "trainer": trainer + (", grad ckpt" if cfg.gradient_checkpointing else ""),
            "micro tokens": str(cfg.micro_batch_tokens or "-"),
        }
        task = Task(cfg.task, seed=cfg.seed)
        return cls(engine, policy, tokenizer, task, params, logger, cfg, labels)

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def rollouts(self, prompts: int, timer: PhaseTimer) -> Rollouts:
        """Sample n completions for each of `prompts` new problems and score them, then release the
        engine's memory for the update."""
        problems = self.task.sample(prompts)
        with timer("generate"):
            ids = encode_prompts(self.tokenizer, problems, self.task.name)
            outs = self.engine.generate(input_ids=ids, sampling_params=self.params, use_tqdm=False)
        rewards = [
            self.task.reward(p, self.tokenizer.decode(c.token_ids, skip_special_tokens=True))
            for p, r in zip(problems, outs)
            for c in r.outputs
        ]
        used = device_used_bytes(self.device)
        with timer("release"):  # weights discarded (new ones come after the update), KV, graphs
            self.engine.release_memory_occupation()
        freed = None if used is None else used - device_used_bytes(self.device)
        batch = rollout_batch(outs, self.tokenizer.pad_token_id or 0).to(self.device)
        return Rollouts(batch, rewards, freed)

    @contextmanager
    def train_phase(self, timer: PhaseTimer) -> Iterator[None]:
        """Times the update as "train" and records its peak device memory (`torch.cuda.max_memory_allocated`:
        all this process's tensors, the policy and its optimizer state included); an out-of-memory error
        in it is re-raised with what to change."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        with raise_with_oom_advice(self.cfg), timer("train"):
            yield
        self.train_peak_bytes = torch.cuda.max_memory_allocated(self.device) if cuda else None

    def finish_step(self, step: int, metrics: dict[str, float], ro: Rollouts, timer: PhaseTimer) -> None:
        """Staged refresh of the engine (weights, sync, KV and graphs), then log the step."""
        synced = refresh_engine(self.policy, self.engine, timer)
        metrics |= rollout_metrics(ro.rewards, ro.batch.completion_lens.tolist(), timer.seconds["generate"])
        metrics |= timer.metrics() | {"sync/gb": synced.bytes / 1e9}
        if ro.freed_bytes is not None:
            metrics["memory/released_gb"] = ro.freed_bytes / 1e9
        if self.train_peak_bytes is not None:
            metrics["memory/train_peak_gb"] = self.train_peak_bytes / 1e9
        self.logger.log(step, metrics)

    def report(self) -> None:
        """After the run: the per-step breakdown as a docs/benchmarks.md row, and the wandb folder."""
        print(benchmark_table(self.labels, self.logger.history))
        if self.logger.run_dir:
            print(f"wandb run written to {self.logger.run_dir}")


@contextmanager
def raise_with_oom_advice(cfg: Any) -> Iterator[None]:
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise TrainerMemoryError(f"{oom_advice(cfg)}\n({e})") from e


def enable_gradient_checkpointing(policy: nn.Module) -> None:
    """Recompute each decoder layer in the backward instead of keeping its activations."""
    kwargs = {"use_reentrant": False}
    if hasattr(policy, "activation_checkpointing_enable"):  # transformers >= 5
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers checkpoints a layer only in training mode: flag the layers alone, so their
    # submodules (dropout included) stay in eval mode
    for module in policy.modules():
        if getattr(module, "gradient_checkpointing", False):
            module.training = True
