"""Trainer-side helpers (never imported by `rollout`): weight sync from a training model to an engine,
and for RL loops `integrations.rl` (rollouts to tensors, losses), `.metrics` (console/wandb), `.tasks`."""

from integrations.weight_sync import BroadcastSender, SyncStats, hf_named_parameters, sync_weights

__all__ = ["BroadcastSender", "SyncStats", "hf_named_parameters", "sync_weights"]
