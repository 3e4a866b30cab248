"""Trainer-side helpers (never imported by `rollout`): weight sync from a training model to an engine,
and torchrun helpers (`integrations.torchrun`)."""

from integrations.weight_sync import BroadcastSender, SyncStats, hf_named_parameters, sync_weights

__all__ = ["BroadcastSender", "SyncStats", "hf_named_parameters", "sync_weights"]
