"""Trainer-side pieces of an RL step on the engine's rollouts.

Every [B, T] tensor here is aligned with `input_ids` (prompt + completion, right-padded): entry t of a
logprob, mask, value or advantage tensor is about token t, so a row reads like its tokens. Entry t of a
logprob is `log_softmax(logits[t - 1] / temperature)[token t]`, the engine's convention (before top-k /
top-p truncation), which makes `exp(trainer - engine)` an unbiased importance ratio.

Rows come request-major, as `Engine.generate` returns them: the n samples of prompt 0, then of prompt 1...
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from integrations.weight_sync import SyncStats, sync_weights
from rollout.outputs import RequestOutput


# -- engine outputs -> training tensors ---------------------------------------------------------------
@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # int64 [B, T]: prompt + completion, right-padded with pad_id
    attention_mask: torch.Tensor  # int64 [B, T]: 1 on real tokens
    loss_mask: torch.Tensor  # float32 [B, T]: 1 on completion (sampled) tokens
    old_logprobs: torch.Tensor  # float32 [B, T]: the engine's logprob of each sampled token, 0 elsewhere
    prompt_lens: torch.Tensor  # int64 [B]
    completion_lens: torch.Tensor  # int64 [B]
    group: torch.Tensor  # int64 [B]: index of the prompt each row was sampled from

    def to(self, device: torch.device | str) -> RolloutBatch:
        return RolloutBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def rows(self, index: torch.Tensor) -> RolloutBatch:
        """The sub-batch of the given rows (for minibatches)."""
        return RolloutBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    @property
    def num_tokens(self) -> int:
        return int(self.completion_lens.sum())


def rollout_batch(outputs: Sequence[RequestOutput], pad_id: int = 0) -> RolloutBatch:
    """Pad every (prompt, completion) pair of `outputs` into one batch; completions need logprobs."""
    rows: list[tuple[list[int], list[int], list[float], int]] = []
    for i, req in enumerate(outputs):
        if not req.outputs:
            raise ValueError(f"outputs[{i}] has no completions")
        for c in req.outputs:
            if c.logprobs is None:
                raise ValueError(
                    f"outputs[{i}] sample {c.index} has no logprobs: "
                    "generate with SamplingParams(logprobs=True)"
                )
            if len(c.logprobs) != len(c.token_ids):
                raise ValueError(
                    f"outputs[{i}] sample {c.index}: {len(c.logprobs)} logprobs for {len(c.token_ids)} tokens"
                )
            rows.append((req.prompt_token_ids, c.token_ids, c.logprobs, i))
    if not rows:
        raise ValueError("no outputs given")
    B, T = len(rows), max(len(p) + len(c) for p, c, _, _ in rows)
    batch = RolloutBatch(
        input_ids=torch.full((B, T), pad_id, dtype=torch.int64),
        attention_mask=torch.zeros(B, T, dtype=torch.int64),
        loss_mask=torch.zeros(B, T),
        old_logprobs=torch.zeros(B, T),
        prompt_lens=torch.tensor([len(p) for p, _, _, _ in rows]),
        completion_lens=torch.tensor([len(c) for _, c, _, _ in rows]),
        group=torch.tensor([g for _, _, _, g in rows]),
    )
    for b, (prompt, completion, logprobs, _) in enumerate(rows):
        P, L = len(prompt), len(completion)
        batch.input_ids[b, : P + L] = torch.tensor(prompt + completion)
        batch.attention_mask[b, : P + L] = 1
        batch.loss_mask[b, P : P + L] = 1
        batch.old_logprobs[b, P : P + L] = torch.tensor(logprobs, dtype=torch.float32)
    return batch


# -- log-probabilities as the engine defines them --------------------------------------------------
def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits: [B, T, V] (position t predicts token t + 1) -> float32 [B, T]; entry 0 is 0.

    The engine's convention: log_softmax(logits / temperature) at the sampled token, before any top-k /
    top-p truncation; temperature 0 (greedy) means plain log_softmax.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scaled = logits[:, :-1].float()
    if temperature > 0:
        scaled = scaled / temperature
    picked = scaled.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return F.pad(picked - scaled.logsumexp(dim=-1), (1, 0))


def shift_to_tokens(per_position: torch.Tensor) -> torch.Tensor:
    """[B, T] values computed at position t - 1 (the state that sampled token t) -> aligned with token t."""
    return F.pad(per_position[:, :-1], (1, 0))


def policy_logprobs(model: nn.Module, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """A Hugging Face causal LM's logprobs of the batch's tokens, float32 [B, T]."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return token_logprobs(logits, batch.input_ids, temperature)


class ValueHead(nn.Module):
    """PPO's critic on the policy's last hidden states: one scalar per position, zero at the start."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.float()).squeeze(-1)


def policy_logprobs_and_values(
    model: nn.Module, value_head: ValueHead, batch: RolloutBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass -> (logprobs, values), both float32 [B, T] aligned with the tokens: values[t] is
    the value of the state that sampled token t (read at position t - 1, like its logprob)."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
    values = shift_to_tokens(value_head(out.hidden_states[-1]))
    return token_logprobs(out.logits, batch.input_ids, temperature), values


def logprob_gap(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Mean and max |trainer - engine| logprob over the sampled tokens: rollout-trainer consistency."""
    diff = (trainer.detach().float() - engine.float()).abs()[mask.bool()]
    if diff.numel() == 0:
        return 0.0, 0.0
    return diff.mean().item(), diff.max().item()


# -- advantages -------------------------------------------------------------------------------------
def check_groups(num_rows: int, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 2:
        raise ValueError(
            f"group_size (samples per prompt, n) must be >= 2 for group advantages, got {group_size}"
        )
    if num_rows % group_size:
        raise ValueError(
            f"{num_rows} rewards do not split into groups of {group_size} (n samples per prompt)"
        )


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, divided by the group's std (population) when `scale`.

    rewards: [B], request-major (consecutive groups of `group_size` samples of one prompt) -> float32 [B].
    A group whose rewards are all equal gets zero advantage (nothing to learn from it).
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    check_groups(rewards.numel(), group_size)
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, correction=0, keepdim=True) + eps)
    return adv.view(-1)


def terminal_rewards(scores: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [B, T]: each row's score on its last completion token, 0 elsewhere."""
    scores = torch.as_tensor(scores, dtype=torch.float32, device=loss_mask.device)
    T = loss_mask.shape[1]
    last = T - 1 - loss_mask.flip(1).argmax(dim=1)  # index of the last 1 in each row
    out = torch.zeros_like(loss_mask, dtype=torch.float32)
    has = loss_mask.sum(dim=1) > 0
    out[has, last[has]] = scores[has]
    return out


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's completion tokens (where `mask` is 1).

    rewards, values, mask: [B, T] aligned with the tokens; values[t] estimates the return from the state
    that sampled token t. The episode ends after the last masked token. Returns (advantages, returns),
    both [B, T] and 0 outside the mask.
    """
    mask = mask.float()
    adv = torch.zeros_like(values, dtype=torch.float32)
    next_value = torch.zeros(values.shape[0], device=values.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(values.shape[1])):
        # the step after t belongs to the episode only where mask[t + 1] is 1
        cont = mask[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(next_value)
        delta = rewards[:, t] + gamma * cont * next_value - values[:, t]
        next_adv = (delta + gamma * lam * cont * next_adv) * mask[:, t]
        adv[:, t] = next_adv
        next_value = values[:, t]
    return adv, (adv + values) * mask


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Normalise x to zero mean, unit std over the masked entries (0 elsewhere)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) / (var.sqrt() + eps) * mask


# -- losses -----------------------------------------------------------------------------------------
@dataclass
class LossStats:
    clip_fraction: float  # share of sampled tokens whose ratio was clipped
    ratio_mean: float
    ratio_max: float


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """PPO's clipped surrogate, averaged over all sampled tokens of the batch.

    logprobs: the trainer's [B, T] (with grad); old_logprobs: the engine's, from the rollout;
    advantages: [B] (one per sequence, GRPO) or [B, T] (per token, PPO).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = loss_mask.float()
    ratio = torch.exp((logprobs - old_logprobs) * mask)  # 1 off the mask, so padding cannot overflow
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + high) * advantages
    loss = masked_mean(-torch.minimum(unclipped, clipped), mask)
    with torch.no_grad():
        was_clipped = (clipped < unclipped).float()
        on = mask.bool()
        stats = LossStats(
            clip_fraction=masked_mean(was_clipped, mask).item(),
            ratio_mean=ratio[on].mean().item() if on.any() else 1.0,
            ratio_max=ratio[on].max().item() if on.any() else 1.0,
        )
    return loss, stats


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
) -> torch.Tensor:
    """0.5 * max((v - R)^2, (v_clipped - R)^2), v_clipped kept within `clip` of the rollout's values."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask.float())


# -- the engine around a training step ---------------------------------------------------------
def use_memory_saver(requested: bool | None, device: str | torch.device | None) -> bool:
    """The engine's `enable_memory_saver`: as requested, or by default on for a CUDA device when the
    optional torch_memory_saver package is installed (without it, release frees no GPU memory)."""
    if requested is not None:
        return requested
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type == "cuda" and importlib.util.find_spec("torch_memory_saver") is not None


def refresh_engine(
    policy: nn.Module, engine: Any, timer: Callable[[str], Any] | None = None, **sync_options: Any
) -> SyncStats:
    """Staged resume after an update: weights first (small), the policy's weights in (`sync_weights`,
    bucketed, cast to the engine's dtype), then KV cache and CUDA graphs, so the peak never holds the
    trainer's step and the engine's cache at once.

    `timer(phase)` (e.g. a PhaseTimer) times the "resume" and "sync" phases when given.
    """
    timer = timer or (lambda phase: nullcontext())
    with timer("resume"):
        engine.resume_memory_occupation(tags=["weights"])
    with timer("sync"):
        stats = sync_weights(policy, engine, **sync_options)
    with timer("resume"):
        engine.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
    return stats
