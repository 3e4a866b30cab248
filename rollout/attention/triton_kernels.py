"""Triton attention kernels over a paged KV cache.

Cache layout of one layer: ``k_cache``/``v_cache`` are ``[num_pages, page_size, Hkv, D]``. Token ``p`` of
request ``b`` lives at page ``page_table[b, p // page_size]``, slot ``p % page_size``. The k/v of the new
tokens are already in the cache when these kernels run.

- ``paged_decode_attention``: one query token per request, split-KV (flash-decoding) in two stages.
- ``paged_extend_attention``: several new query tokens per request (prefill / extend), causal,
  flash-attention style tiling with online softmax.

All softmax math is fp32 and uses exp2 with the scale folded into ``log2(e) * sm_scale``. Both entry
points are CUDA-graph safe: no host syncs, grids depend only on shapes and Python ints.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


def _upcast_dot(dtype: torch.dtype) -> bool:
    # The CPU interpreter multiplies bf16 operands of tl.dot as raw uint16 bit patterns (triton 3.x), so
    # there the operands are upcast to fp32 first. Compiled GPU kernels never take this path.
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dot_precision() -> str:
    # Only affects fp32 operands: 3xTF32 is close to fp32 accuracy (plain TF32 is not) but still uses tensor
    # cores; "ieee" FMA dots spill registers badly. AMD has no tf32x3.
    return "ieee" if torch.version.hip else "tf32x3"


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PREC: tl.constexpr):
    # fp32 accumulation.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _page_slot(page_table_ptr, pt_row, pos, mask, PAGE_SIZE: tl.constexpr):
    # Token positions -> (page id, slot in page), int64 because page * page_stride can overflow int32.
    page = tl.load(page_table_ptr + pt_row + pos // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    slot = (pos % PAGE_SIZE).to(tl.int64)
    return page, slot


# --------------------------------------------------------------------------------------------------------
# Decode: split-KV, stage 1 computes per-split partial results, stage 2 merges them.
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _decode_stage1_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [num_pages, page_size, Hkv, D]
    v_ptr,  # [num_pages, page_size, Hkv, D]
    page_table_ptr,  # [B, max_pages] int32
    seq_lens_ptr,  # [B] int32
    part_o_ptr,  # [B, Hq, S, D] fp32, normalized partial output of each split
    part_lse_ptr,  # [B, Hq, S] fp32, base-2 log-sum-exp of each split
    qk_scale,  # sm_scale * log2(e)
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,  # query heads per kv head
    NUM_SPLITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # GROUP padded to >= 16 so the group can go through tl.dot
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    # Split length is a multiple of BLOCK_N; trailing splits are empty for short sequences.
    split_len = tl.cdiv(seq_len, NUM_SPLITS * BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < GROUP
    heads = kvh * GROUP + offs_h  # query heads of this group

    # q: [BLOCK_H, D]; padded rows are zero and never stored.
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_h[:, None], other=0.0
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    pt_row = b.to(tl.int64) * stride_pt

    for start_n in range(start, end, BLOCK_N):
        pos = start_n + offs_n
        mask_n = pos < end
        page, slot = _page_slot(page_table_ptr, pt_row, pos, mask_n, PAGE_SIZE)
        k_off = page * stride_kp + slot * stride_ks + kvh * stride_kh
        v_off = page * stride_vp + slot * stride_vs + kvh * stride_vh
        # k_t: [D, BLOCK_N], v: [BLOCK_N, D]
        k_t = tl.load(k_ptr + k_off[None, :] + offs_d[:, None], mask=mask_n[None, :], other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)

        s = _dot(q, k_t, UPCAST_DOT, DOT_PREC) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoid (-inf) - (-inf)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST_DOT, DOT_PREC)
        m_i = m_new

    # Empty split: l_i == 0 -> lse = -inf and a zero partial output, which stage 2 ignores.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    o = acc / l_safe[:, None]

    o_ptrs = part_o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, o, mask=mask_h[:, None])
    tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_stage2_kernel(
    part_o_ptr,  # [B, Hq, S, D] fp32
    part_lse_ptr,  # [B, Hq, S] fp32
    out_ptr,  # [B, Hq, D]
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS padded to a power of two
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_s = offs_s < NUM_SPLITS

    # lse: [BLOCK_S]; missing/empty splits are -inf.
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (seq_len 0): weights become 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)

    # part: [BLOCK_S, D]
    part = tl.load(
        part_o_ptr + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
        mask=mask_s[:, None],
        other=0.0,
    )
    o = tl.sum(part * w[:, None], 0) / denom
    tl.store(out_ptr + b * stride_outb + h * stride_outh + offs_d, o.to(out_ptr.dtype.element_ty))


def _decode_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for decode stage 1.

    Picked from sm_90 compile stats (no spills, modest registers), not from GPU benchmarks yet.
    """
    if dtype == torch.float32:
        return 32, 4 if head_dim <= 128 else 8
    if head_dim > 128:
        return 32, 4
    return 64, 4


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int, head_dim: int) -> int:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "cache must be [pages, page_size, Hkv, D]"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    num_kv_heads = k_cache.shape[2]
    assert k_cache.shape[3] == head_dim, "q and cache head_dim differ"
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two >= 16"
    return num_kv_heads


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,
    num_kv_splits: int = 8,
) -> torch.Tensor:
    """Single-token attention per request over the paged cache.

    q: [B, Hq, D]; page_table: int32 [B, max_pages]; seq_lens: int32 [B] (kv length incl. the current
    token; 0 for padding rows, whose output is zero). Returns out: [B, Hq, D] in q's dtype.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = _check_cache(k_cache, v_cache, num_q_heads, head_dim)
    group = num_q_heads // num_kv_heads
    page_size = k_cache.shape[1]
    num_splits = max(1, int(num_kv_splits))
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if batch == 0:
        return out

    # Workspace depends only on shapes, so it is safe to allocate inside a CUDA graph capture.
    part_o = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)

    block_h = max(16, triton.next_power_of_2(group))
    block_n, num_warps = _decode_config(head_dim, q.dtype)
    _decode_stage1_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        part_o,
        part_lse,
        sm_scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        NUM_SPLITS=num_splits,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        UPCAST_DOT=_upcast_dot(q.dtype),
        DOT_PREC=_dot_precision(),
        num_warps=num_warps,
        num_stages=2,
    )
    _decode_stage2_kernel[(batch, num_q_heads)](
        part_o,
        part_lse,
        out,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        num_warps=4,
    )
    return out


# --------------------------------------------------------------------------------------------------------
# Extend / prefill: causal flash attention with the KV read through the page table.
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _extend_attn_block(
    acc,
    l_i,
    m_i,
    q,
    k_ptr,
    v_ptr,
    page_table_ptr,
    pt_row,
    kvh,
    start_n,
    q_pos,
    kv_len,
    qk_scale,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    CAUSAL_MASK: tl.constexpr,  # False for blocks fully below the diagonal: skips all masking
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_n = offs_n < kv_len
    page, slot = _page_slot(page_table_ptr, pt_row, offs_n, mask_n, PAGE_SIZE)
    k_off = page * stride_kp + slot * stride_ks + kvh * stride_kh
    v_off = page * stride_vp + slot * stride_vs + kvh * stride_vh
    # k_t: [D, BLOCK_N], v: [BLOCK_N, D]
    if CAUSAL_MASK:
        k_t = tl.load(k_ptr + k_off[None, :] + offs_d[:, None], mask=mask_n[None, :], other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    else:
        k_t = tl.load(k_ptr + k_off[None, :] + offs_d[:, None])
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :])

    s = _dot(q, k_t, UPCAST_DOT, DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
    if CAUSAL_MASK:
        keep = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoid (-inf) - (-inf)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST_DOT, DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _extend_kernel(
    q_ptr,  # [total_q, Hq, D]
    k_ptr,  # [num_pages, page_size, Hkv, D]
    v_ptr,  # [num_pages, page_size, Hkv, D]
    out_ptr,  # [total_q, Hq, D]
    page_table_ptr,  # [B, max_pages] int32
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    qk_scale,  # sm_scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    m_start = m_block * BLOCK_M
    if m_start >= q_len:  # grid is sized for max_q_len; shorter requests exit early
        return
    kv_len = tl.load(seq_lens_ptr + b)
    prefix = kv_len - q_len  # cached tokens before the first new token
    kvh = h // GROUP

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < q_len
    q_pos = prefix + offs_m  # absolute position of each query row

    # q: [BLOCK_M, D]
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mask_m[:, None], other=0.0
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    pt_row = b.to(tl.int64) * stride_pt

    # kv blocks entirely before the first query row of this block are visible to every row: no masks.
    first_q_pos = prefix + m_start
    full_end = (first_q_pos // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _extend_attn_block(
            acc, l_i, m_i, q, k_ptr, v_ptr, page_table_ptr, pt_row, kvh, start_n, q_pos, kv_len, qk_scale,
            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            False, PAGE_SIZE, HEAD_DIM, BLOCK_N, UPCAST_DOT, DOT_PREC,
        )  # fmt: skip
    # Diagonal blocks: causal + length masks.
    diag_end = tl.minimum(first_q_pos + BLOCK_M, kv_len)
    for start_n in range(full_end, diag_end, BLOCK_N):
        acc, l_i, m_i = _extend_attn_block(
            acc, l_i, m_i, q, k_ptr, v_ptr, page_table_ptr, pt_row, kvh, start_n, q_pos, kv_len, qk_scale,
            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            True, PAGE_SIZE, HEAD_DIM, BLOCK_N, UPCAST_DOT, DOT_PREC,
        )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def _extend_config(head_dim: int, dtype: torch.dtype, max_q_len: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for the extend kernel; max_q_len is a host int, so graph-safe.

    Picked from sm_90 compile stats (no spills, shared memory < 100 KB), not from GPU benchmarks yet.
    Short query chunks use 64-row tiles to waste less of each tile.
    """
    if dtype == torch.float32:  # debug/reference path: fp32 tiles are twice as large
        if head_dim <= 64:
            return 32, 32, 4
        return (16, 32, 4) if head_dim <= 128 else (16, 16, 8)
    if head_dim > 128:
        return 64, 32, 8
    if max_q_len > 64:
        return 128, 64, 8
    return 64, 64, 4


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,
    max_q_len: int,
) -> torch.Tensor:
    """Causal attention of the new tokens of each request over its whole paged KV (prefix + new).

    q: [total_q, Hq, D]; cu_seqlens_q: int32 [B + 1]; seq_lens: int32 [B] total kv length per request;
    max_q_len: host int >= every q_len (sizes the grid). Returns out: [total_q, Hq, D] in q's dtype.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    total_q, num_q_heads, head_dim = q.shape
    num_kv_heads = _check_cache(k_cache, v_cache, num_q_heads, head_dim)
    batch = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if total_q == 0 or batch == 0 or max_q_len <= 0:
        return out

    block_m, block_n, num_warps = _extend_config(head_dim, q.dtype, max_q_len)
    grid = (batch, num_q_heads, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        cu_seqlens_q,
        seq_lens,
        sm_scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        GROUP=num_q_heads // num_kv_heads,
        PAGE_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        UPCAST_DOT=_upcast_dot(q.dtype),
        DOT_PREC=_dot_precision(),
        num_warps=num_warps,
        num_stages=2,
    )
    return out
