"""GRPO on the rollout engine: a transformers policy and the engine share one process and one device.

Each step: the engine samples n completions per prompt (with logprobs) -> verifiable rewards -> the engine
releases its memory -> group-normalised advantages, clipped policy loss whose importance ratio uses the
engine's logprobs, optimizer steps -> staged resume: weights, sync, then KV cache and CUDA graphs.
With no --model it trains the built-in tiny model (random weights) to repeat the digit of its prompt: the
mean reward climbs from about 0.02 to about 0.9 in 40 steps, some 10 seconds on a 2-core CPU.

    python3 examples/grpo.py                                   # tiny model, on cuda when present
    python3 examples/grpo.py --model path/to/ckpt --task add --steps 200 --batch 32 --n 8 --wandb

At real shapes (e.g. `--model $(python3 scripts/models.py qwen2.5-0.5b)`, a random checkpoint with the
151,936-token vocabulary) the trainer's memory is bounded by `--micro-batch-tokens` (gradients accumulate
over micro-batches; the optimizer still steps --minibatches times a pass), `--gradient-checkpointing` and
`--autocast bf16`; logits are never materialised for a whole batch (see docs/rl.md). The run ends with
its per-step breakdown as a docs/benchmarks.md table row.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from integrations.cli import loop_parser, parsed, run_example
from integrations.loop import ColocatedLoop, check_loop_config
from integrations.lora import build_lora_loop
from integrations.metrics import PhaseTimer
from integrations.rl import (
    LossStats,
    RolloutBatch,
    check_groups,
    clipped_policy_loss,
    group_advantages,
    logprob_gap,
    micro_batches,
    policy_logprobs,
    trainer_autocast,
)
from integrations.routing_replay import RouteRecorder, RoutingReplay, route_mismatch


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
    epochs: int = 1  # passes over each step's rollouts
    minibatches: int = 2  # optimizer steps per pass; batch * n must split evenly into them
    micro_batch_tokens: int | None = None  # padded tokens per forward (gradients accumulate); None: minibatch
    gradient_checkpointing: bool = False  # recompute each layer in the backward
    autocast: str = "none"  # the trainer's forward: none (float32) or bf16 (weights stay float32)
    seed: int = 0
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str = "auto"  # the engine's: auto is bfloat16 on a GPU, float32 on a CPU
    mem_fraction: float = 0.3  # GPU share for the engine's weights + KV cache (the trainer uses the rest)
    memory_saver: bool | None = None  # free GPU memory on release; None: on for CUDA with torch_memory_saver
    wandb: bool = False
    wandb_dir: str | None = None
    progress: bool = True
    lora_rank: int = 0  # > 0: train a LoRA adapter of this rank, not every weight (integrations/lora.py)
    # MoE policies: the trainer's forwards use the engine's routed experts (integrations/routing_replay.py)
    routing_replay: bool = False

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: no LoRA), got {self.lora_rank}")
        if self.n < 2:
            raise ValueError(f"n must be >= 2: GRPO compares the samples of one prompt, got n={self.n}")
        check_loop_config(self)


def replaying(replay: RoutingReplay | None, routes: torch.Tensor | None, rows, width: int):
    """The context a micro-batch's forward runs in: the engine's routes of `rows` replayed, or nothing."""
    if replay is None or routes is None:
        return contextlib.nullcontext()
    return replay.use(routes[rows][:, :width])


def minibatch_backward(
    policy: torch.nn.Module,
    batch: RolloutBatch,
    rows: torch.Tensor,
    advantages: torch.Tensor,
    cfg: Config,
    replay: RoutingReplay | None = None,
    routes: torch.Tensor | None = None,
) -> tuple[float, LossStats]:
    """Backward of the clipped loss of the minibatch `rows`, in micro-batches of at most
    cfg.micro_batch_tokens: each averages over the whole minibatch's tokens, so the accumulated
    gradient is the unsplit minibatch's. Returns the minibatch's loss and stats."""
    tokens = batch.loss_mask[rows].sum().item()
    loss_sum, stats = 0.0, LossStats(0.0, 0.0, 0.0)
    for micro in micro_batches(batch, rows, cfg.micro_batch_tokens):
        mb = batch.rows(micro).trimmed()
        with (
            trainer_autocast(cfg.autocast, mb.input_ids.device),
            replaying(replay, routes, micro, mb.input_ids.shape[1]),
        ):
            logprobs = policy_logprobs(policy, mb, cfg.temperature)
        loss, part = clipped_policy_loss(
            logprobs, mb.old_logprobs, advantages[micro], mb.loss_mask, cfg.clip_eps, num_tokens=tokens
        )
        loss.backward()
        loss_sum, stats = loss_sum + loss.item(), stats + part
    return loss_sum, stats


@torch.no_grad()
def trainer_logprobs(
    policy: torch.nn.Module,
    batch: RolloutBatch,
    cfg: Config,
    replay: RoutingReplay | None = None,
    routes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float | None]:
    """The trainer's logprobs of the whole batch, for the rollout-trainer gap: in micro-batches, or
    minibatches without a token budget. With the engine's routes and no replay, also the fraction of
    tokens whose routes differ between engine and trainer in some MoE layer."""
    out = torch.zeros_like(batch.old_logprobs)
    rows = out.shape[0]
    budget = cfg.micro_batch_tokens or rows // cfg.minibatches * out.shape[1]
    differ = counted = 0
    for micro in micro_batches(batch, torch.arange(rows, device=out.device), budget):
        mb = batch.rows(micro).trimmed()
        width = mb.input_ids.shape[1]
        record = RouteRecorder(policy).record() if routes is not None and replay is None else None
        with trainer_autocast(cfg.autocast, out.device), replaying(replay, routes, micro, width):
            with record or contextlib.nullcontext() as own:
                out[micro, :width] = policy_logprobs(policy, mb, cfg.temperature)
        if own:
            engine_routes = routes[micro][:, :width]
            valid = engine_routes[..., 0, 0] >= 0  # tokens the engine ran forward
            frac = route_mismatch(engine_routes, own[0].view(engine_routes.shape), valid)
            differ, counted = differ + frac * int(valid.sum()), counted + int(valid.sum())
    return out, (differ / counted if counted else None)


def grpo_update(
    policy: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: RolloutBatch,
    rewards: list[float],
    cfg: Config,
    shuffle: torch.Generator,
    routes: torch.Tensor | None = None,
) -> dict[str, float]:
    """One GRPO update on a step's rollouts; returns its metrics, the logprob gap included."""
    check_groups(len(rewards), cfg.n)
    advantages = group_advantages(torch.tensor(rewards), cfg.n).to(batch.input_ids.device)
    size = len(rewards) // cfg.minibatches
    # the policy still holds the weights the engine sampled with
    replay = RoutingReplay(policy) if cfg.routing_replay and routes is not None else None
    trainer, route_gap = trainer_logprobs(policy, batch, cfg, replay, routes)
    gap_mean, gap_max = logprob_gap(trainer, batch.old_logprobs, batch.loss_mask)
    losses, clip_fracs, ratio_max = [], [], 0.0
    for _ in range(cfg.epochs):
        order = torch.randperm(len(rewards), generator=shuffle).to(batch.input_ids.device)
        for start in range(0, len(rewards), size):
            opt.zero_grad(set_to_none=True)
            rows = order[start : start + size]
            loss, stats = minibatch_backward(policy, batch, rows, advantages, cfg, replay, routes)
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            losses.append(loss)
            clip_fracs.append(stats.clip_fraction)
            ratio_max = max(ratio_max, stats.ratio_max)
    if replay is not None:
        replay.remove()
    routes_metric = {} if route_gap is None else {"routes/differ": route_gap}
    return routes_metric | {
        "loss/policy": sum(losses) / len(losses),
        "loss/clip_fraction": sum(clip_fracs) / len(clip_fracs),
        "loss/ratio_max": ratio_max,
        "logprob_gap/mean": gap_mean,
        "logprob_gap/max": gap_max,
    }


def train(cfg: Config) -> list[dict[str, float]]:
    """Run the loop; returns each step's metrics."""
    torch.manual_seed(cfg.seed)
    loop = (build_lora_loop if cfg.lora_rank else ColocatedLoop.build)(cfg, project="rollout-grpo")
    opt = torch.optim.AdamW(loop.policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    shuffle = torch.Generator().manual_seed(cfg.seed)  # minibatch order
    with loop.logger:
        for step in range(cfg.steps):
            timer = PhaseTimer(loop.device)
            ro = loop.rollouts(cfg.batch, timer)
            with loop.train_phase(timer):
                metrics = grpo_update(loop.policy, opt, ro.batch, ro.rewards, cfg, shuffle, ro.routes)
            loop.finish_step(step, metrics, ro, timer)
    loop.report()
    return loop.logger.history


def parse_args(argv: list[str] | None = None) -> Config:
    d = Config()
    ap = loop_parser(d, __doc__)
    ap.add_argument("--lora-rank", type=int, default=d.lora_rank, help="> 0: train a LoRA of this rank")
    ap.add_argument(
        "--routing-replay",
        action="store_true",
        help="MoE policies: replay the engine's routed experts in the trainer's forwards (R3)",
    )
    return Config(**vars(ap.parse_args(argv)))


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    return run_example(train, parsed(parse_args, argv))


if __name__ == "__main__":
    main()
