"""How large flashinfer's float workspace must be: the split-KV partial outputs of one plan.

When flashinfer splits a request's KV into chunks it writes float32 partial outputs (tmp_v) and their
log-sum-exps (tmp_s) into the workspace, one row per query tile. A fixed 128 MiB buffer is too small for
wide models: Qwen3-30B-A3B's shape (32 query heads of 128, 4 KV heads) needs 201 MB to plan a CUDA-graph
decode batch of 512, and exactly 128 MiB for an eager prefill, so plans failed with "Buffer overflow
... Increase the workspace buffer size". The bounds below follow flashinfer 0.5's scheduler
(include/flashinfer/attention/scheduler.cuh): a split-KV grid of two CTAs per SM, query tiles of
cta_tile_q rows holding a request's rows times the query group.
"""

from __future__ import annotations

MIN_BYTES = 128 << 20
SLACK = 1 << 20  # the allocator's 16-byte alignment of each array, and the small arrays beside them


def cta_tile_q(packed_rows: int, head_dim: int) -> int:
    """flashinfer's query tile (FA2DetermineCtaTileQ) on Ampere and newer."""
    if packed_rows > 64 and head_dim < 256:
        return 128
    return 64 if packed_rows > 16 else 16


def split_kv_bytes(
    num_qo_heads: int, num_kv_heads: int, head_dim: int, num_sm: int, graph_batch: int = 0
) -> int:
    """The most tmp_v + tmp_s bytes one plan can ask for: any eager plan (graph_batch=0), or a decode
    plan captured for `graph_batch` requests."""
    group = num_qo_heads // num_kv_heads
    split_rows = 2 * num_sm // num_kv_heads  # flashinfer's max_batch_size_if_split
    # eager: a plan splits KV only while its tiles fit the grid, and a tile holds at most 128 rows
    rows = split_rows * 128
    # the CUDA-core decode kernel (no tensor cores): one row per request and head, grid-bound
    rows = max(rows, 2 * num_sm, graph_batch)
    if graph_batch:
        # a graph's plan is padded for any lengths: one tile per request beyond its packed rows
        tile = cta_tile_q(group, head_dim)
        tiles = max(split_rows, -(-graph_batch * group // tile) + graph_batch - 1)
        rows = max(rows, tiles * tile)
    return 4 * num_qo_heads * (head_dim + 1) * rows


def workspace_bytes(
    num_qo_heads: int, num_kv_heads: int, head_dim: int, num_sm: int, graph_batch: int = 0
) -> int:
    need = split_kv_bytes(num_qo_heads, num_kv_heads, head_dim, num_sm, graph_batch) + SLACK
    return max(MIN_BYTES, need)
