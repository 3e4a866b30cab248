"""GRPO on Ray: rollout engines in a RolloutGroup of actors, the policy in a trainer actor of its own.

Each step: the driver sends the prompts to the group (split across the engines, all n samples of a
prompt on one engine) -> verifiable rewards -> the trainer actor takes a GRPO step on the outputs ->
the trainer broadcasts its new weights to every engine in one group (it is rank 0; gloo on the CPU,
NCCL between GPUs). Sampling is seeded per prompt, so the rollouts do not depend on how many engines
share the batch. With no --model it trains the built-in tiny model to repeat the digit of its prompt.

    python3 examples/ray_grpo.py                               # CPU: 2 engines + trainer, local Ray
    python3 examples/ray_grpo.py --dry-run                     # two small steps end to end
    python3 examples/ray_grpo.py --num-gpus-per-actor 1 --trainer-gpus 1 --actors 1   # 2 GPUs
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from integrations.cli import loop_parser, parsed, run_example
from integrations.loop import check_loop_config
from integrations.metrics import MetricsLogger, PhaseTimer, rollout_metrics
from integrations.ray import RolloutGroup
from integrations.rl import (
    clipped_policy_loss,
    group_advantages,
    logprob_gap,
    micro_batches,
    policy_logprobs,
    rollout_batch,
    trainer_autocast,
)
from integrations.tasks import Task, char_tokenizer
from rollout import SamplingParams
from rollout.models.toy import default_model_dir
from rollout.outputs import RequestOutput

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Config:
    model: str | None = None  # HF checkpoint folder; None: the built-in tiny model
    threads: int | None = None  # torch's CPU threads; None: 1 for the built-in model on a CPU
    task: str = "repeat"
    steps: int = 40
    batch: int = 16  # prompts per step
    n: int = 8  # samples per prompt (the GRPO group)
    max_new_tokens: int = 8
    lr: float = 3e-3
    temperature: float = 1.0
    clip_eps: float = 0.2
    epochs: int = 1
    minibatches: int = 2  # optimizer steps per pass; batch * n must split evenly into them
    micro_batch_tokens: int | None = None  # padded tokens per forward (gradients accumulate); None: minibatch
    gradient_checkpointing: bool = False  # recompute each layer in the backward
    autocast: str = "none"  # the trainer's forward: none (float32) or bf16 (weights stay float32)
    seed: int = 0
    device: str | None = None  # the trainer's: None is cuda when it has a GPU, else cpu
    dtype: str = "auto"  # the engines': bfloat16 on a GPU, float32 on a CPU
    mem_fraction: float = 0.85  # each engine's share of its GPU
    memory_saver: bool | None = None  # unused: engines have devices of their own and never release
    wandb: bool = False
    wandb_dir: str | None = None
    progress: bool = True
    actors: int = 2  # rollout engines
    num_gpus_per_actor: float = 0.0
    trainer_gpus: float = 0.0
    num_cpus: int = 4  # of the local Ray cluster this starts (when none is running)
    backend: str | None = None  # broadcast backend; None: nccl between GPUs, gloo otherwise
    dry_run: bool = False  # two small steps

    def __post_init__(self) -> None:
        if self.n < 2:
            raise ValueError(f"n must be >= 2: GRPO compares the samples of one prompt, got n={self.n}")
        check_loop_config(self)

    def effective(self) -> Config:
        """The run's settings: --dry-run shrinks it; engines sharing the trainer's one GPU use gloo and
        split the memory."""
        cfg = self
        if cfg.dry_run:
            cfg = dataclasses.replace(cfg, steps=2, batch=4, n=4, minibatches=1)
        gpus = cfg.trainer_gpus + cfg.actors * cfg.num_gpus_per_actor
        if 0 < gpus <= 1 and cfg.trainer_gpus and cfg.num_gpus_per_actor:  # one GPU for everything
            share = min(cfg.mem_fraction, 0.8 / (cfg.actors + 1))
            cfg = dataclasses.replace(cfg, backend=cfg.backend or "gloo", mem_fraction=share)
        return cfg


class Trainer:
    """The policy (float32) and its optimizer, in an actor of its own (on its own GPU when given one).
    It holds a copy of the rollout group, through which it broadcasts its weights as rank 0."""

    def __init__(self, cfg: Config, model_dir: str, group: RolloutGroup):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(cfg.seed)
        self.cfg, self.group = cfg, group
        self.device = torch.device(cfg.device or ("cuda" if ray.get_gpu_ids() else "cpu"))
        # eval(): dropout off, so the ratio compares one function, not two draws
        self.policy = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device).eval()
        )
        if cfg.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.shuffle = torch.Generator().manual_seed(cfg.seed)

    def update(self, outputs: list[RequestOutput], rewards: list[float], pad_id: int) -> dict[str, float]:
        """One GRPO step on the rollouts, then the new weights out to every engine."""
        cfg, timer = self.cfg, PhaseTimer(self.device)
        batch = rollout_batch(outputs, pad_id).to(self.device)
        advantages = group_advantages(torch.tensor(rewards), cfg.n).to(self.device)
        with timer("train"):
            with torch.no_grad():  # the policy still holds the weights the engines sampled with
                gap_mean, gap_max = logprob_gap(
                    policy_logprobs(self.policy, batch, cfg.temperature), batch.old_logprobs, batch.loss_mask
                )
            losses = [self._minibatch(batch, advantages, rows) for rows in self._minibatches(len(rewards))]
        with timer("sync"):
            synced = self.group.sync_weights(self.policy, backend=cfg.backend)
        return timer.metrics() | {
            "loss/policy": sum(losses) / len(losses),
            "logprob_gap/mean": gap_mean,
            "logprob_gap/max": gap_max,
            "sync/gb": synced.bytes / 1e9,
        }

    def _minibatches(self, rows: int) -> list[torch.Tensor]:
        """Each epoch's rows in a fresh order, cut into `minibatches` chunks."""
        size = rows // self.cfg.minibatches
        orders = [torch.randperm(rows, generator=self.shuffle) for _ in range(self.cfg.epochs)]
        return [chunk for order in orders for chunk in order.split(size)]

    def _minibatch(self, batch: Any, advantages: torch.Tensor, rows: torch.Tensor) -> float:
        """One optimizer step on `rows`, accumulated over micro-batches of at most micro_batch_tokens
        (each loss over the whole minibatch's tokens, so the gradient is the unsplit minibatch's)."""
        cfg, rows = self.cfg, rows.to(self.device)
        tokens = batch.loss_mask[rows].sum().item()
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for micro in micro_batches(batch, rows, cfg.micro_batch_tokens):
            mb = batch.rows(micro).trimmed()
            with trainer_autocast(cfg.autocast, self.device):
                logprobs = policy_logprobs(self.policy, mb, cfg.temperature)
            loss, _ = clipped_policy_loss(
                logprobs, mb.old_logprobs, advantages[micro], mb.loss_mask, cfg.clip_eps, num_tokens=tokens
            )
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
        self.opt.step()
        return total


def seeded_params(cfg: Config, step: int) -> list[SamplingParams]:
    """One seed per prompt: samples independent of which engine, and beside which prompts, they run."""
    return [
        SamplingParams(
            n=cfg.n,
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            logprobs=True,
            seed=(cfg.seed * 1_000_003 + step) * cfg.batch + j,
        )
        for j in range(cfg.batch)
    ]


def load_tokenizer(model_dir: str) -> Any:
    if not (Path(model_dir) / "tokenizer_config.json").exists():
        return char_tokenizer()  # random real-shaped checkpoints ship none
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def start_ray(cfg: Config) -> None:
    """A local cluster, unless one is running; workers import this checkout (rollout, integrations)."""
    if ray.is_initialized():
        return
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})


def train(cfg: Config) -> list[dict[str, float]]:
    """Run the loop; returns each step's metrics."""
    cfg = cfg.effective()
    start_ray(cfg)
    model_dir = str(cfg.model or default_model_dir())
    group = RolloutGroup(
        cfg.actors,
        model_dir,
        num_gpus=cfg.num_gpus_per_actor,
        num_cpus=1,
        seed=cfg.seed,
        dtype=cfg.dtype,
        mem_fraction=cfg.mem_fraction,
    )
    trainer = None
    try:
        trainer_class = ray.remote(Trainer).options(num_cpus=1, num_gpus=cfg.trainer_gpus)
        trainer = trainer_class.remote(cfg, model_dir, group)  # the group travels; it broadcasts from there
        return _loop(cfg, group, trainer, load_tokenizer(model_dir))
    finally:
        if trainer is not None:
            ray.kill(trainer)
        group.shutdown()


def _loop(cfg: Config, group: RolloutGroup, trainer: Any, tokenizer: Any) -> list[dict[str, float]]:
    task = Task(cfg.task, seed=cfg.seed)
    pad_id = tokenizer.pad_token_id or 0
    logger = MetricsLogger(
        cfg.steps,
        use_wandb=cfg.wandb,
        project="rollout-ray-grpo",
        config=dataclasses.asdict(cfg),
        wandb_dir=cfg.wandb_dir,
        progress=cfg.progress,
    )
    with logger:
        for step in range(cfg.steps):
            timer = PhaseTimer()
            problems = task.sample(cfg.batch)
            with timer("generate"):
                ids = [tokenizer.encode(p.prompt) for p in problems]
                outs = group.generate(input_ids=ids, sampling_params=seeded_params(cfg, step))
            rewards = [
                task.reward(p, tokenizer.decode(c.token_ids, skip_special_tokens=True))
                for p, r in zip(problems, outs)
                for c in r.outputs
            ]
            metrics = ray.get(trainer.update.remote(outs, rewards, pad_id))
            lengths = [len(c.token_ids) for r in outs for c in r.outputs]
            metrics |= rollout_metrics(rewards, lengths, timer.seconds["generate"]) | timer.metrics()
            logger.log(step, metrics)
    return logger.history


def parse_args(argv: list[str] | None = None) -> Config:
    d = Config()
    ap = loop_parser(d, __doc__)
    ap.add_argument("--actors", type=int, default=d.actors, help="rollout engines (Ray actors)")
    ap.add_argument("--num-gpus-per-actor", type=float, default=d.num_gpus_per_actor)
    ap.add_argument("--trainer-gpus", type=float, default=d.trainer_gpus, help="GPUs of the trainer actor")
    ap.add_argument("--num-cpus", type=int, default=d.num_cpus, help="CPUs of the local Ray cluster")
    ap.add_argument("--backend", default=None, choices=["nccl", "gloo"], help="weight broadcast backend")
    ap.add_argument("--dry-run", action="store_true", help="two small steps end to end")
    return Config(**vars(ap.parse_args(argv)))


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    return run_example(train, parsed(parse_args, argv))


if __name__ != "__main__":
    # imported as a file (tests): ship the Trainer class by value, workers cannot import this module
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

if __name__ == "__main__":
    main()
