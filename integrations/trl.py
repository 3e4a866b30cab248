"""TRL's GRPOTrainer generating with this engine, through TRL's vLLM colocate path.

TRL (1.16) builds `vllm.LLM` in `trl.generation.vllm_generation` and calls `generate`, `sleep`,
`wake_up`, `reset_prefix_cache` and `llm_engine...model.load_weights` on it. `install()` points that
module's names at `rollout.compat.vllm` (the only place TRL looks them up), so a GRPOConfig with
`use_vllm=True, vllm_mode="colocate"` runs on this engine with vLLM not installed:

    from integrations.trl import RolloutGRPOTrainer
    trainer = RolloutGRPOTrainer(model=..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate"), ...)

`RolloutGRPOTrainer` also pushes the policy's weights into the engine right after each optimizer
step (TRL alone pushes them lazily, at the next generation).
"""

from __future__ import annotations

from typing import Any

import trl
from transformers import TrainerCallback
from trl.generation import vllm_generation

from rollout.compat import vllm as front

_ORIGINAL = {
    name: getattr(vllm_generation, name, None) for name in ("LLM", "SamplingParams", "RequestOutput")
}


def install(**llm_options: Any) -> None:
    """Make TRL's colocate mode build this engine; `llm_options` (e.g. device="cpu") are added to the
    arguments TRL passes to `LLM(...)`. Calling it again replaces the options."""

    def make_llm(**kwargs: Any) -> front.LLM:
        return front.LLM(**{**kwargs, **llm_options})

    vllm_generation.LLM = make_llm
    vllm_generation.SamplingParams = front.SamplingParams
    vllm_generation.RequestOutput = front.RequestOutput
    vllm_generation.is_vllm_available = lambda *args, **kwargs: True


def uninstall() -> None:
    """Give TRL its own names back (vLLM's when it is installed)."""
    for name, value in _ORIGINAL.items():
        if value is None:
            vars(vllm_generation).pop(name, None)
        else:
            setattr(vllm_generation, name, value)
    from trl.import_utils import is_vllm_available

    vllm_generation.is_vllm_available = is_vllm_available


class SyncAfterStep(TrainerCallback):
    """Push the policy into the engine after every optimizer step, and tell TRL it is done."""

    def __init__(self, trainer: trl.GRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        generation = getattr(self.trainer, "vllm_generation", None)
        if generation is None:
            return
        generation.sync_weights()
        self.trainer._last_loaded_step = state.global_step  # TRL then skips its own lazy sync


class RolloutGRPOTrainer(trl.GRPOTrainer):
    """GRPOTrainer on this engine (colocate mode); `llm_options` go to `rollout.compat.vllm.LLM`."""

    def __init__(self, *args: Any, llm_options: dict[str, Any] | None = None, **kwargs: Any):
        config = kwargs.get("args")
        if config is not None and not (config.use_vllm and config.vllm_mode == "colocate"):
            raise ValueError("RolloutGRPOTrainer needs GRPOConfig(use_vllm=True, vllm_mode='colocate')")
        install(**(llm_options or {}))
        super().__init__(*args, **kwargs)
        self.add_callback(SyncAfterStep(self))
