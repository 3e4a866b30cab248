"""Trainer-side helpers (never imported by `rollout`): weight sync from a training model to an engine,
torchrun helpers (`integrations.torchrun`), and for RL loops `integrations.rl` (rollouts to tensors,
losses), `integrations.metrics` (console, tqdm, wandb) and `integrations.tasks` (verifiable tasks)."""

from integrations.verify import WeightMismatchError, verify_sync
from integrations.weight_sync import BroadcastSender, SyncStats, hf_named_parameters, sync_weights

__all__ = [
    "BroadcastSender",
    "SyncStats",
    "WeightMismatchError",
    "hf_named_parameters",
    "sync_weights",
    "verify_sync",
]
