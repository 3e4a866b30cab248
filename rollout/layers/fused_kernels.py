"""Triton kernels behind layers/fused.py (launchers take preallocated outputs; see there for semantics).

Each kernel is bandwidth-trivial: one program per row (RMSNorm, rotary) or per block of elements
(SiLU-and-mul), float32 math, one rounding to the output dtype at the same places as the torch code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scale(x, inv, w_ptr, offs, mask, ty, CENTRED: tl.constexpr):
    """The normalised row times the weight: w * round(x_hat) (Llama: torch rounds the normalised row to
    the model dtype first), or x_hat * (1 + w) in float32 with one rounding at the end (CENTRED: Qwen3.5's
    zero-centred norm)."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if CENTRED:
        return (x * inv * (1.0 + w)).to(ty)
    return (w * (x * inv).to(ty).to(tl.float32)).to(ty)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, stride_a, stride_b, B, N, eps, BLOCK_N: tl.constexpr, CENTRED: tl.constexpr
):
    row = tl.program_id(0)
    a, b = row // B, row % B
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + a.to(tl.int64) * stride_a + b * stride_b + offs, mask=mask, other=0.0)
    x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    y = _scale(x, inv, w_ptr, offs, mask, out_ptr.dtype.element_ty, CENTRED)
    tl.store(out_ptr + row.to(tl.int64) * N + offs, y, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, centred: bool = False
) -> None:
    # x: [A, B, N] (last dim contiguous), out: [A, B, N] contiguous
    A, B, N = x.shape
    block = triton.next_power_of_2(N)
    _rms_norm_kernel[(A * B,)](
        x,
        weight,
        out,
        x.stride(0),
        x.stride(1),
        B,
        N,
        eps,
        BLOCK_N=block,
        CENTRED=centred,
        num_warps=min(16, max(1, block // 256)),
    )


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, N, eps, BLOCK_N: tl.constexpr, CENTRED: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    s = (x + r).to(ty)  # torch adds in the model dtype: round the sum, then normalise the rounded value
    tl.store(res_ptr + row * N + offs, s, mask=mask)
    s = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / N + eps)
    tl.store(out_ptr + row * N + offs, _scale(s, inv, w_ptr, offs, mask, ty, CENTRED), mask=mask)


def add_rms_norm(x, residual, weight, eps: float, out, res_out, centred: bool = False) -> None:
    # x, residual, out, res_out: [T, N] contiguous
    T, N = x.shape
    block = triton.next_power_of_2(N)
    _add_rms_norm_kernel[(T,)](x, residual, weight, out, res_out, N, eps, BLOCK_N=block, CENTRED=centred,
                               num_warps=min(16, max(1, block // 256)))  # fmt: skip


@triton.jit
def _rotate_heads(x_ptr, out_ptr, stride_t, stride_h, stride_ot, stride_oh, t, cos, sin,
                  H: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < H) & (d[None, :] < HALF)
    src = x_ptr + t * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cs_ptr, qo_ptr, ko_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                 stride_qot, stride_qoh, stride_kot, stride_koh,
                 HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    cos = tl.load(cs_ptr + t * stride_cs + d, mask=dm, other=0.0)[None, :]
    sin = tl.load(cs_ptr + t * stride_cs + HALF + d, mask=dm, other=0.0)[None, :]
    _rotate_heads(q_ptr, qo_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, cos, sin,
                  HQ, HALF, BLOCK_HQ, BLOCK_D)  # fmt: skip
    _rotate_heads(k_ptr, ko_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t, cos, sin,
                  HK, HALF, BLOCK_HK, BLOCK_D)  # fmt: skip


def rope(q, k, cos_sin, q_out, k_out) -> None:
    # q: [T, Hq, D], k: [T, Hkv, D] (last dim contiguous); cos_sin: float32 [T, D]; outputs contiguous
    T, HQ, D = q.shape
    HK = k.shape[1]
    cos_sin = cos_sin.float()
    _rope_kernel[(T,)](
        q, k, cos_sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        HQ=HQ, HK=HK, HALF=D // 2,
        BLOCK_HQ=triton.next_power_of_2(HQ), BLOCK_HK=triton.next_power_of_2(HK),
        BLOCK_D=triton.next_power_of_2(D // 2), num_warps=4,
    )  # fmt: skip


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    # torch rounds silu(gate) to the model dtype before the product
    act = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)
    tl.store(out_ptr + t * inter + offs, (act * up).to(ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    # gate_up: [T, 2 * inter] (last dim contiguous), out: [T, inter] contiguous
    T, inter = out.shape
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(T, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), inter, BLOCK=block, num_warps=4
    )
