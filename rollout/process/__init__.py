"""Another process and what crosses to it: child lifecycle (start, facts, stop, reap), `EngineProcess`
(the Engine's API one call at a time), the engine worker (the step loop over a pipe), the wire
protocol, and tensor handles (IPC).

May import: engine/ and everything below it. Never fronts/, serve/ or compat/.
"""

from rollout.process.child import KILL_GRACE_S, freeze_heap, reap, serve_child, stop_child
from rollout.process.engine_process import EngineProcess, RemoteTraceback

__all__ = [
    "KILL_GRACE_S",
    "EngineProcess",
    "RemoteTraceback",
    "freeze_heap",
    "reap",
    "serve_child",
    "stop_child",
]
