"""The fused MoE experts in Triton: sort the (token, expert) pairs by expert, two grouped GEMMs, combine.

    fused_experts(h [T, H], gate_up [E, 2I, H], down [E, H, I], weights [T, K], ids [T, K], valid)

1. align (torch ops, no host sync): the T*K (token, slot) entries are sorted stably by expert and each
   expert's run padded to a multiple of BLOCK_M, into a buffer of static size T*K + E*(BLOCK_M - 1);
   each block of BLOCK_M rows knows its expert (E: an empty block past the end, which exits at once).
   Entries with expert id -1, and every entry of a row at or past `valid` (the padding rows of a
   captured CUDA-graph batch), sort into no expert: no GEMM work, and their output is masked to zero.
2. gate/up GEMM: each program takes one block of one expert and BLOCK_N columns of both the gate and
   the up half, gathers the block's token rows of h, and writes silu(gate) * up (float32 math, one
   rounding to the model dtype) to the entry's row of an [T*K, I] buffer.
3. down GEMM: the same blocks over that buffer and `down`, times the entry's routing weight, to an
   [T*K, H] float32 buffer (each entry its own row: no atomics, so results are deterministic).
4. combine: each token's K rows summed in float32 and rounded once to the model dtype.

Every shape depends on T alone, so a decode step of a fixed batch size is captured in a CUDA graph.
Float32 models use IEEE float32 dots (no TF32), so they agree with torch's float32 to reassociation.
On the CPU (tests, under TRITON_INTERPRET=1) half-precision tiles are widened to float32 before the dot:
the interpreter's bfloat16 dot is wrong, and the widened products are exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_up_kernel(
    h_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    num_entries, num_experts, top_k, H, I,  # noqa: E741
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e >= num_experts:
        return
    entry = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = entry < num_entries
    token = (entry // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + token[:, None] * H + offs_k[None, :]
    g_ptrs = w_ptr + e * 2 * I * H + offs_n[None, :].to(tl.int64) * H + offs_k[:, None]
    u_ptrs = g_ptrs + I * H
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        k_ok = offs_k < H - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc_g += tl.dot(a, g, input_precision="ieee")
            acc_u += tl.dot(a, u, input_precision="ieee")
        elif UPCAST:
            acc_g += tl.dot(a.to(tl.float32), g.to(tl.float32))
            acc_u += tl.dot(a.to(tl.float32), u.to(tl.float32))
        else:
            acc_g += tl.dot(a, g)
            acc_u += tl.dot(a, u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_ptrs = out_ptr + entry[:, None].to(tl.int64) * I + offs_n[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    x_ptr, w_ptr, weights_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    num_entries, num_experts, H, I,  # noqa: E741
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e >= num_experts:
        return
    entry = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = entry < num_entries
    entry64 = entry.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + entry64[:, None] * I + offs_k[None, :]
    b_ptrs = w_ptr + e * H * I + offs_n[None, :].to(tl.int64) * I + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(I, BLOCK_K)):
        k_ok = offs_k < I - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        elif UPCAST:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    weight = tl.load(weights_ptr + entry64, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(out_ptr + entry64[:, None] * H + offs_n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


def block_sizes(num_entries: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small row blocks when experts get few tokens each (decode), larger
    ones for prefill, where the weights are reused across more rows."""
    block_m = 16 if num_entries <= 1024 else 32 if num_entries <= 8192 else 64
    block_k = 32 if dtype == torch.float32 else 64
    return block_m, 64, block_k


def align(
    ids: torch.Tensor, num_experts: int, block_m: int, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted entry ids [P] int32, each block's expert [P / block_m] int32) for ids [T, K]; padding
    slots hold T*K (no entry), blocks past the last expert's hold num_experts. No host sync."""
    T, K = ids.shape
    M, E, dev = T * K, num_experts, ids.device
    key = ids.reshape(-1).to(torch.int64)
    routed = key >= 0
    if valid is not None:
        routed &= torch.arange(M, device=dev) < valid * K
    key = torch.where(routed, key, E)  # unrouted entries: bucket E, past every expert
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).index_add_(
        0, key, torch.ones(M, dtype=torch.int64, device=dev)
    )
    padded = (counts[:E] + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    rank = torch.arange(M, device=dev) - count_start[sorted_key]
    P = -(-(M + E * (block_m - 1)) // block_m) * block_m
    dest = torch.where(sorted_key < E, pad_start[sorted_key.clamp(max=E - 1)] + rank, P)
    sorted_ids = torch.full((P + 1,), M, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, P, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, starts, right=True).to(torch.int32)
    return sorted_ids[:P], block_expert


def fused_experts(
    h: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor | None = None,
    blocks: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * down[e] @ (silu(gate[e] @ h[t]) * up[e] @ h[t]), e = ids[t, k], for each
    token t as [T, H] in h's dtype. ids -1 (or rows >= valid): no expert. `blocks`: (BLOCK_M, BLOCK_N,
    BLOCK_K) instead of block_sizes' choice (tests use large blocks to keep the interpreter quick)."""
    T, H = h.shape
    K = ids.shape[1]
    E, I2, _ = gate_up.shape
    I = I2 // 2  # noqa: E741
    M = T * K
    if M == 0:
        return torch.zeros_like(h)
    h = h.contiguous()
    bm, bn, bk = blocks or block_sizes(M, h.dtype)
    sorted_ids, block_expert = align(ids, E, bm, valid)
    num_blocks = block_expert.numel()
    ieee = h.dtype == torch.float32
    upcast = not h.is_cuda  # the Triton interpreter (CPU) has no bfloat16 dot: exact float32 products
    inter = torch.empty(M, I, dtype=h.dtype, device=h.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(I, bn))](
        h, gate_up, inter, sorted_ids, block_expert, M, E, K, H, I,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee, UPCAST=upcast,
    )  # fmt: skip
    partial = torch.empty(M, H, dtype=torch.float32, device=h.device)
    _down_kernel[(num_blocks, triton.cdiv(H, bn))](
        inter, down, weights.contiguous(), partial, sorted_ids, block_expert, M, E, H, I,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee, UPCAST=upcast,
    )  # fmt: skip
    routed = ids >= 0
    if valid is not None:
        routed = routed & (torch.arange(T, device=h.device) < valid)[:, None]
    partial = torch.where(routed.reshape(M, 1), partial, 0.0)
    return partial.view(T, K, H).sum(dim=1).to(h.dtype)
