"""Trainer-side helpers for RL on the rollout engine (the engine package `rollout` never imports this)."""
