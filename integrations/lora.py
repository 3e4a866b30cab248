"""LoRA on the trainer side: send a PEFT model's adapter (megabytes, not the model) to an engine, and the
colocated RL loop with a LoRA policy (examples/grpo.py --lora-rank).

The engine keeps the base weights exact and applies the adapter unmerged (rollout/lora), so a sync is
`load_lora_adapter_from_tensors(name, ..., replace=True)`: an in-place copy into the adapter's slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from integrations.loop import ColocatedLoop, Rollouts
from integrations.metrics import PhaseTimer, rollout_metrics
from integrations.rl import rollout_batch
from rollout import Engine, SamplingParams

ADAPTER = "policy"  # the engine-side name of the loop's adapter


@dataclass(frozen=True)
class LoraSyncStats:
    tensors: int
    bytes: int
    seconds: float


def lora_state(peft_model: Any, adapter_name: str = "default") -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter's tensors by PEFT state-dict name (detached) and its config as a plain dict."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
    config = peft_model.peft_config[adapter_name].to_dict()
    # plain values: the config may cross a process boundary (EngineProcess, Ray) as JSON-like data
    plain = {k: sorted(v) if isinstance(v, set) else getattr(v, "value", v) for k, v in config.items()}
    return {k: v.detach() for k, v in state.items()}, plain


def sync_lora(
    peft_model: Any, engine: Any, name: str, *, adapter_name: str = "default", abort: bool = False
) -> LoraSyncStats:
    """Load (or replace in place) the engine's adapter `name` with `peft_model`'s adapter weights only."""
    t0 = time.perf_counter()
    tensors, config = lora_state(peft_model, adapter_name)
    engine.load_lora_adapter_from_tensors(name, tensors, config, replace=True, abort=abort)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return LoraSyncStats(len(tensors), nbytes, time.perf_counter() - t0)


def lora_policy(policy: torch.nn.Module, rank: int, seed: int) -> torch.nn.Module:
    """Wrap a transformers policy in a PEFT LoRA of `rank` on every decoder linear layer (B starts at 0,
    so the adapted policy equals the base at first, as the engine's does)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # A's random init
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
    return get_peft_model(policy, config)


class LoraLoop(ColocatedLoop):
    """The colocated loop with a LoRA policy: the engine's base weights stay resident and exact (a
    release frees only the KV cache and graphs), rollouts sample with the adapter, and the refresh sends
    only the adapter."""

    @classmethod
    def build(cls, cfg: Any, project: str) -> LoraLoop:
        loop = super().build(cfg, project)  # cls is LoraLoop here: the loop is one already
        model = loop.engine.config.model
        loop.engine.shutdown()  # its engine has no adapter slots: replaced, after it freed its memory
        loop.engine = Engine(
            model,
            device=cfg.device,
            dtype=cfg.dtype,
            seed=cfg.seed,
            mem_fraction=cfg.mem_fraction,
            max_loras=1,
            max_lora_rank=cfg.lora_rank,
        )
        loop.policy = lora_policy(loop.policy, cfg.lora_rank, cfg.seed)
        sync_lora(loop.policy, loop.engine, ADAPTER)
        loop.params = SamplingParams(
            n=cfg.n, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, logprobs=True,
            lora_name=ADAPTER,
        )  # fmt: skip
        return loop

    def rollouts(self, prompts: int, timer: PhaseTimer) -> Rollouts:
        problems = self.task.sample(prompts)
        with timer("generate"):
            ids = [self.tokenizer.encode(p.prompt) for p in problems]
            outs = self.engine.generate(input_ids=ids, sampling_params=self.params, use_tqdm=False)
        rewards = [
            self.task.reward(p, self.tokenizer.decode(c.token_ids, skip_special_tokens=True))
            for p, r in zip(problems, outs)
            for c in r.outputs
        ]
        with timer("release"):  # the base weights stay: they never change
            self.engine.release_memory_occupation(["kv_cache", "cuda_graph"])
        batch = rollout_batch(outs, self.tokenizer.pad_token_id or 0).to(self.device)
        return Rollouts(batch, rewards, None)

    def finish_step(self, step: int, metrics: dict[str, float], ro: Rollouts, timer: PhaseTimer) -> None:
        with timer("sync"):
            synced = sync_lora(self.policy, self.engine, ADAPTER)
        with timer("resume"):
            self.engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
        metrics |= rollout_metrics(ro.rewards, ro.batch.completion_lens.tolist(), timer.seconds["generate"])
        metrics |= timer.metrics() | {"sync/gb": synced.bytes / 1e9}
        self.logger.log(step, metrics)


def build_lora_loop(cfg: Any, project: str) -> LoraLoop:
    """examples/grpo.py --lora-rank: the loop with a LoRA policy of rank cfg.lora_rank."""
    return LoraLoop.build(cfg, project)
