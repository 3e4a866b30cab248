"""Fronts shaped like SGLang's and vLLM's Python APIs over the one engine (see docs/compat.md).

Each front translates names and shapes, then calls `rollout.Engine`; none has logic of its own.

May import: fronts/, process/, engine/ and below; never serve/.
"""

from __future__ import annotations

from collections.abc import Iterable


def with_graphs(tags: str | Iterable[str] | None, released: frozenset[str]) -> list[str] | None:
    """Waking the KV cache also wakes the captured graphs, which replay over it (SGLang's callers
    resume only "weights" and "kv_cache")."""
    if tags is None:
        return None
    tags = [tags] if isinstance(tags, str) else list(tags)
    if "kv_cache" in tags and "cuda_graph" in released and "cuda_graph" not in tags:
        tags.append("cuda_graph")
    return tags
