"""Trainer-side helpers for rollout (weight sync, torchrun, metrics); rollout/ never imports them."""
