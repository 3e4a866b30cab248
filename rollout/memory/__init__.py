"""Giving the GPU back to the trainer: tagged regions (saver.py), host copies (host_copy.py) and the
engine's release/resume state machine (manager.py). See docs/memory.md.

May import: cache/ and the top-level value modules. Never runner/ or above.
"""

from rollout.memory.manager import MemoryManager
from rollout.memory.saver import (
    TAGS,
    CudaMemorySaver,
    MemorySaver,
    check_tags,
    expandable_segments_requested,
    make_memory_saver,
)

__all__ = [
    "TAGS",
    "CudaMemorySaver",
    "MemoryManager",
    "MemorySaver",
    "check_tags",
    "expandable_segments_requested",
    "make_memory_saver",
]
