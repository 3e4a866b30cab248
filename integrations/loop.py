"""The plumbing every colocated RL loop repeats: set-up, rollouts with rewards, release, then the
staged refresh and the step's metrics. The examples keep only their update rule."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from integrations.metrics import MetricsLogger, PhaseTimer, device_used_bytes, rollout_metrics
from integrations.rl import RolloutBatch, refresh_engine, rollout_batch, use_memory_saver
from integrations.tasks import Task, char_tokenizer
from rollout import Engine, SamplingParams
from rollout.toy import default_model_dir


@dataclass
class Rollouts:
    """One step's samples as training tensors, their rewards (request-major) and what release freed."""

    batch: RolloutBatch
    rewards: list[float]
    freed_bytes: int | None  # device memory the release gave back (None off CUDA)


@dataclass
class ColocatedLoop:
    """An engine and a float32 transformers policy on one device, a task, and the step logger.

    `cfg` is an example's Config: model, task, seed, n, temperature, max_new_tokens, device, dtype,
    mem_fraction, memory_saver, steps, wandb, wandb_dir, progress.
    """

    engine: Engine
    policy: nn.Module
    tokenizer: Any
    task: Task
    params: SamplingParams
    logger: MetricsLogger

    @classmethod
    def build(cls, cfg: Any, project: str) -> ColocatedLoop:
        model_dir = str(cfg.model or default_model_dir())
        engine = Engine(
            model_dir,
            device=cfg.device,
            dtype=cfg.dtype,
            seed=cfg.seed,
            mem_fraction=cfg.mem_fraction,
            enable_memory_saver=use_memory_saver(cfg.memory_saver, cfg.device),
        )
        # float32 master weights; eval() turns dropout off, so the ratio compares one function, not two draws
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(engine.device).eval()
        params = SamplingParams(
            n=cfg.n, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, logprobs=True
        )
        logger = MetricsLogger(
            cfg.steps,
            use_wandb=cfg.wandb,
            project=project,
            config=dataclasses.asdict(cfg),
            wandb_dir=cfg.wandb_dir,
            progress=cfg.progress,
        )
        tokenizer = engine.tokenizer or char_tokenizer()  # random real-shaped checkpoints ship none
        return cls(engine, policy, tokenizer, Task(cfg.task, seed=cfg.seed), params, logger)

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def rollouts(self, prompts: int, timer: PhaseTimer) -> Rollouts:
        """Sample n completions for each of `prompts` new problems and score them, then release the
        engine's memory for the update."""
        problems = self.task.sample(prompts)
        with timer("generate"):
            ids = [self.tokenizer.encode(p.prompt) for p in problems]
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

    def finish_step(self, step: int, metrics: dict[str, float], ro: Rollouts, timer: PhaseTimer) -> None:
        """Staged refresh of the engine (weights, sync, KV and graphs), then log the step."""
        synced = refresh_engine(self.policy, self.engine, timer)
        metrics |= rollout_metrics(ro.rewards, ro.batch.completion_lens.tolist(), timer.seconds["generate"])
        metrics |= timer.metrics() | {"sync/gb": synced.bytes / 1e9}
        if ro.freed_bytes is not None:
            metrics["memory/released_gb"] = ro.freed_bytes / 1e9
        self.logger.log(step, metrics)
