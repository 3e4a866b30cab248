"""The async fronts: `AsyncEngine` (the engine on a thread of this process), `ProcessAsyncEngine` (the
engine in a worker process), the async front they share, and stream deltas.

May import: process/, engine/ and everything below. Never serve/ or compat/.
"""
