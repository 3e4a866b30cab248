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
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from integrations.params import unwrap_model
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

    def trimmed(self) -> RolloutBatch:
        """The same rows without the padding columns none of them reaches (right padding: a row's
        results do not depend on the columns after it)."""
        width = int((self.prompt_lens + self.completion_lens).max())
        return RolloutBatch(**{f.name: _trim(getattr(self, f.name), width) for f in fields(self)})


def _trim(t: torch.Tensor, width: int) -> torch.Tensor:
    return t[:, :width] if t.dim() == 2 else t


def micro_batches(batch: RolloutBatch, rows: torch.Tensor, max_tokens: int | None) -> list[torch.Tensor]:
    """Split `rows` of `batch` into groups whose padded size (rows x longest row) stays within
    `max_tokens`, for gradient accumulation; None: one group. A row longer than the budget goes alone.

    Rows are grouped by length, so little padding is computed.
    """
    if max_tokens is None:
        return [rows]
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = (batch.prompt_lens + batch.completion_lens)[rows]
    groups: list[list[int]] = []
    width = 0
    for i in lengths.argsort(descending=True).tolist():
        if groups and (len(groups[-1]) + 1) * width <= max_tokens:
            groups[-1].append(i)  # sorted longest first: this row does not widen the group
        else:
            groups.append([i])
            width = int(lengths[i])
    return [rows[torch.tensor(g, device=rows.device)] for g in groups]


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


# The trainer never holds a batch's [B, T, V] logits (151,936 a token for Qwen: 0.6 MB in float32): it
# projects the final hidden states of the completion positions only, a chunk of tokens at a time, and the
# backward recomputes each chunk's logits, so memory follows the chunk, not the batch.
LOGITS_CHUNK_BYTES = 256 << 20  # float32 logits of one chunk


def chunk_size(vocab_size: int, chunk_tokens: int | None = None) -> int:
    """Tokens a chunk projects at once: `chunk_tokens`, or as many as fit LOGITS_CHUNK_BYTES."""
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        return chunk_tokens
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


def _chunk_logprobs(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, temperature: float):
    logits = head(hidden).float()  # float32 math inside the chunk, whatever the matmul's dtype
    if temperature > 0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(dim=-1)


def sampled_logprobs(
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """log_softmax(head(hidden) / temperature)[targets] for hidden [N, H], targets [N] -> float32 [N].

    Chunks of `chunk_size` tokens; with grad enabled each chunk is checkpointed, so neither pass keeps
    more than one chunk's logits (the backward recomputes them).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    size = chunk_size(head.out_features, chunk_tokens)
    parts = []
    for h, t in zip(hidden.split(size), targets.split(size)):
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logprobs, h, head, t, temperature, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(h, head, t, temperature))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


# configs whose logits are not lm_head(hidden): the chunked head would silently differ from forward()
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """(decoder, lm_head) of a Hugging Face causal LM, to compute hidden states and logits apart."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) or unwrap_model(model) is not model or not hasattr(model, "get_decoder"):
        raise TypeError(
            f"{type(model).__name__} is not a plain transformers causal LM: to train through DDP or FSDP2, "
            "wrap TokenLogprobs(policy) (whose forward runs the chunked head), not the policy"
        )
    for name in LOGIT_TRANSFORMS:
        if getattr(model.config, name, None) not in (None, 1, 1.0):
            raise NotImplementedError(f"{type(model).__name__} transforms its logits ({name})")
    return model.get_decoder(), model.get_output_embeddings()


def _logprobs_and_hidden(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    temperature: float,
    chunk_tokens: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [B, T] of the completion tokens, 0 elsewhere; final hidden states [B, T, H])."""
    decoder, head = causal_lm_parts(model)
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    sampled = loss_mask[:, 1:].bool()  # position t predicts token t + 1: only completion tokens count
    picked = sampled_logprobs(
        hidden[:, :-1][sampled], head, input_ids[:, 1:][sampled], temperature, chunk_tokens
    )
    logprobs = torch.zeros(sampled.shape, device=hidden.device).masked_scatter(sampled, picked)
    return F.pad(logprobs, (1, 0)), hidden


def policy_logprobs(
    model: nn.Module, batch: RolloutBatch, temperature: float = 1.0, *, chunk_tokens: int | None = None
) -> torch.Tensor:
    """A Hugging Face causal LM's logprobs of the batch's completion tokens, float32 [B, T], 0 elsewhere.

    Equal to `token_logprobs(model(...).logits, ...)` on the completion tokens, without the full logits.
    `model` may also be a TokenLogprobs, wrapped by DDP or FSDP2 or not.
    """
    args = (batch.input_ids, batch.attention_mask, batch.loss_mask, temperature)
    if isinstance(unwrap_model(model), TokenLogprobs):
        return model(*args)  # through the wrapper's forward
    return _logprobs_and_hidden(model, *args, chunk_tokens)[0]


class TokenLogprobs(nn.Module):
    """`policy_logprobs` as a module, for wrappers whose forward has to run (DDP's gradient hooks,
    FSDP2's unsharding): wrap this, not the policy, and pass the wrapper to `policy_logprobs`."""

    def __init__(self, policy: nn.Module, chunk_tokens: int | None = None):
        super().__init__()
        self.policy = policy
        self.chunk_tokens = chunk_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        temperature: float,
    ) -> torch.Tensor:
        args = (input_ids, attention_mask, loss_mask, temperature, self.chunk_tokens)
        return _logprobs_and_hidden(self.policy, *args)[0]


class ValueHead(nn.Module):
    """PPO's critic on the policy's last hidden states: one scalar per position, zero at the start."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.float()).float().squeeze(-1)  # float32 under autocast too


def policy_logprobs_and_values(
    model: nn.Module,
    value_head: ValueHead,
    batch: RolloutBatch,
    temperature: float = 1.0,
    *,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass -> (logprobs, values), both float32 [B, T] aligned with the tokens: values[t] is
    the value of the state that sampled token t (read at position t - 1, like its logprob)."""
    args = (batch.input_ids, batch.attention_mask, batch.loss_mask, temperature, chunk_tokens)
    logprobs, hidden = _logprobs_and_hidden(model, *args)
    return logprobs, shift_to_tokens(value_head(hidden))


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


def masked_mean(x: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None) -> torch.Tensor:
    """Sum of x over the mask / num_tokens (default: the mask's count)."""
    return (x * mask).sum() / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Normalise x to zero mean, unit std over the masked entries (0 elsewhere)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) / (var.sqrt() + eps) * mask


# -- losses -----------------------------------------------------------------------------------------
@dataclass
class LossStats:
    """Over the loss's `num_tokens`: so the stats of micro-batches add up to their minibatch's."""

    clip_fraction: float  # share of sampled tokens whose ratio was clipped
    ratio_mean: float
    ratio_max: float

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(
            self.clip_fraction + other.clip_fraction,
            self.ratio_mean + other.ratio_mean,
            max(self.ratio_max, other.ratio_max),
        )


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """PPO's clipped surrogate, averaged over all sampled tokens of the batch.

    logprobs: the trainer's [B, T] (with grad); old_logprobs: the engine's, from the rollout;
    advantages: [B] (one per sequence, GRPO) or [B, T] (per token, PPO). `num_tokens`: the count to
    average over, by default the mask's; a micro-batch passes its minibatch's, so that the micro-batches'
    losses (and gradients) add up to the minibatch's.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = loss_mask.float()
    ratio = torch.exp((logprobs - old_logprobs) * mask)  # 1 off the mask, so padding cannot overflow
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + high) * advantages
    loss = masked_mean(-torch.minimum(unclipped, clipped), mask, num_tokens)
    with torch.no_grad():
        on = mask.bool()
        stats = LossStats(
            clip_fraction=masked_mean((clipped < unclipped).float(), mask, num_tokens).item(),
            ratio_mean=masked_mean(ratio, mask, num_tokens).item(),
            ratio_max=ratio[on].max().item() if on.any() else 1.0,
        )
    return loss, stats


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
    num_tokens: float | None = None,
) -> torch.Tensor:
    """0.5 * max((v - R)^2, (v_clipped - R)^2), v_clipped kept within `clip` of the rollout's values;
    averaged over `num_tokens` as in `clipped_policy_loss`."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    worst = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * masked_mean(worst, mask.float(), num_tokens)


# -- the trainer's precision -------------------------------------------------------------------------
AUTOCAST = {
    "none": None,
    "bf16": torch.bfloat16,
}  # --autocast: the forward's matmul dtype (weights stay fp32)


def trainer_autocast(mode: str, device: torch.device | str) -> AbstractContextManager[Any]:
    """The context the trainer's forward runs in: bf16 autocast, or plain float32 ("none")."""
    if mode not in AUTOCAST:
        raise ValueError(f"autocast must be one of {sorted(AUTOCAST)}, got {mode!r}")
    dtype = AUTOCAST[mode]
    return nullcontext() if dtype is None else torch.autocast(torch.device(device).type, dtype=dtype)


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
