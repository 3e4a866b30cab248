"""The state the engine and the runner share: a request and its sequences (`Request`, `Sequence`,
`Status`, per-row randomness) and one step's plan (`ScheduledBatch`).

May import: the top-level value modules (sampling, outputs). Nothing else of rollout.
"""
