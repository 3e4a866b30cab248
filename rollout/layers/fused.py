"""Fused Triton kernels for the decoder's elementwise work: RMSNorm, rotary embedding of q and k, and
SiLU-and-multiply.

In plain torch a layer runs about 40 small kernels besides its matmuls (RMSNorm alone is 8); a decode
step at small batch is then bound by kernel count, not by memory bandwidth. Each function here is one
kernel with the same rounding points as the torch code it replaces (float32 math, rounding to the model
dtype where torch rounds), so results agree to within float32 reassociation.

Used on CUDA tensors when triton is importable; `ROLLOUT_FUSED_OPS=0` turns them off (for comparison).
The functions run on any device, so CPU tests use them under the Triton interpreter.
"""

from __future__ import annotations

import importlib.util
import os

import torch

_ENABLED = os.environ.get("ROLLOUT_FUSED_OPS", "1") != "0" and importlib.util.find_spec("triton") is not None


def use_fused(x: torch.Tensor) -> bool:
    """Whether the model should call these kernels for `x` (CUDA tensors, triton present, not disabled)."""
    return _ENABLED and x.is_cuda


def _kernels():
    # imported on first use: importing triton is slow and it is optional on a CPU
    from rollout.layers import fused_kernels

    return fused_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, centred: bool = False) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim, as layers.norm.RMSNorm (`centred`: (1 + weight) * ..., as
    Qwen3.5's zero-centred norm); x: [..., N], any strides whose last dim is contiguous and whose
    leading dims are at most two. Returns a contiguous tensor."""
    if x.dim() > 3 or x.stride(-1) != 1:
        x = x.reshape(-1, x.shape[-1])
    x3 = x if x.dim() == 3 else x.reshape(-1, 1, x.shape[-1])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        _kernels().rms_norm(x3, weight, eps, out.view(x3.shape), centred)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, centred: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one kernel, the sum rounded to the model dtype as the
    unfused `residual + x` is; x, residual: [T, N]."""
    x, residual = x.contiguous(), residual.contiguous()
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    if x.numel():
        _kernels().add_rms_norm(x, residual, weight, eps, out, res_out, centred)
    return out, res_out


def rope(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-layout rotary embedding of q [T, Hq, D] and k [T, Hkv, D] (last dim contiguous) with
    cos_sin [T, D] (cos half | sin half, float32), as models.llama.rope; returns contiguous copies."""
    q_out, k_out = (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
    )
    if q.shape[0]:
        _kernels().rope(q, k, cos_sin, q_out, k_out)
    return q_out, k_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * I] (gate | up), as F.silu(gate) * up; returns [T, I]."""
    T, I2 = gate_up.shape
    out = torch.empty((T, I2 // 2), dtype=gate_up.dtype, device=gate_up.device)
    if T:
        _kernels().silu_mul(gate_up, out)
    return out
