"""Triton kernel of the gated delta rule's decode step (semantics: gated_delta.decode_torch).

One program per (request, value head, block of Dv columns): it reads the request's slot, loads that
state block [Dk, BV] once, decays it, applies the delta update and reads the output from it, and writes
it back: the state crosses memory once each way, which is the floor of a decode step. q and k are
normalised inside (the L2 norms cost Dk flops per program). The slot indices are read on the device,
so the launch has no host sync and CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pool_ptr, slots_ptr, out_ptr,
    HV, REP, DK, DV, scale, eps,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // REP
    HK = HV // REP
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    mk, mv = offs_k < DK, offs_v < DV
    q = tl.load(q_ptr + (b * HK + hk) * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + (b * HK + hk) * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    v = tl.load(v_ptr + (b * HV + h) * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * HV + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * HV + h).to(tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    base = pool_ptr + (slot * HV + h) * DK * DV
    ptrs = base + offs_k[:, None] * DV + offs_v[None, :]
    m2 = mk[:, None] & mv[None, :]
    S = tl.load(ptrs, mask=m2, other=0.0).to(tl.float32) * tl.exp(g)
    u = (v - tl.sum(S * k[:, None], axis=0)) * beta
    S = S + k[:, None] * u[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(ptrs, S.to(pool_ptr.dtype.element_ty), mask=m2)
    tl.store(out_ptr + (b * HV + h) * DV + offs_v, o.to(out_ptr.dtype.element_ty), mask=mv)


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv]; pool [S, Hv, Dk, Dv] (contiguous), slots [B].
    Returns o [B, Hv, Dv] in v's dtype; pool[slots] are updated in place."""
    B, HV, DV = v.shape
    DK = q.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty_like(v)
    BK = triton.next_power_of_2(DK)
    BV = min(32, triton.next_power_of_2(DV))
    grid = (B, HV, triton.cdiv(DV, BV))
    _decode_kernel[grid](
        q, k, v, g, beta, pool, slots, out,
        HV, HV // q.shape[1], DK, DV, DK**-0.5, 1e-6,
        BK=BK, BV=BV,
    )  # fmt: skip
    return out
