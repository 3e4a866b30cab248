"""Fused Triton RMSNorm / rotary / SiLU-and-mul against the torch code they replace.

Without CUDA they run in the Triton interpreter, whose float32 -> bfloat16 conversion is not
round-to-nearest (an ulp off at times), so bf16 is compared to 2 ulp there; float32 and float16 must
agree to float32 reassociation (float16 rounding is exact in the interpreter).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from rollout.layers import fused
from rollout.layers.norm import RMSNorm
from rollout.layers.rotary import Rotary
from rollout.models.llama import rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def check(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:  # one ulp of the output dtype (two for bf16 in the interpreter), float32 noise otherwise
        ulp = torch.finfo(ref.dtype).eps * (2 if ref.dtype == torch.bfloat16 else 1)
        torch.testing.assert_close(got.float(), ref.float(), atol=1e-3, rtol=ulp)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.norm.RMSNorm's torch path (as in transformers)."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def qkv_views(T: int, hq: int, hkv: int, d: int, dtype: torch.dtype):
    """q [T, hq, d] and k [T, hkv, d] as strided views of one fused projection, like the model's."""
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=DEVICE).to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(T, hq, d), k.view(T, hkv, d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_rows_and_strided_heads(dtype):
    torch.manual_seed(0)
    weight = torch.empty(896, device=DEVICE).uniform_(0.5, 1.5).to(dtype)
    x = torch.randn(7, 896, device=DEVICE).to(dtype) * 3
    check(fused.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6))
    head_weight = torch.empty(64, device=DEVICE).uniform_(0.5, 1.5).to(dtype)
    q, _ = qkv_views(5, 7, 1, 64, dtype)  # Qwen3's per-head q_norm on a strided view
    out = fused.rms_norm(q, head_weight, 1e-6)
    assert out.is_contiguous()
    check(out, torch_rms_norm(q, head_weight, 1e-6))
    if DEVICE == "cuda":  # the module takes the fused path on a GPU
        norm = RMSNorm(896, 1e-6, dtype=dtype, device=DEVICE)
        norm.weight.data.copy_(weight)
        check(norm(x), torch_rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(7, 1, 64), (4, 2, 128), (4, 4, 16)])
def test_rope_matches_the_torch_rotation(dtype, heads):
    torch.manual_seed(1)
    hq, hkv, d = heads
    q, k = qkv_views(6, hq, hkv, d, dtype)
    rotary = Rotary(d, 4096, 1e6, None, device=DEVICE)
    cos_sin = rotary.cos_sin[torch.tensor([0, 1, 15, 16, 1000, 4095], device=DEVICE)]
    gq, gk = fused.rope(q, k, cos_sin)
    check(gq, rope(q, cos_sin))
    check(gk, rope(k, cos_sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    torch.manual_seed(2)
    gate_up = torch.randn(5, 2 * 1300, device=DEVICE).to(dtype) * 4  # > one 1024 block per row
    gate, up = gate_up.split(1300, dim=-1)
    check(fused.silu_mul(gate_up), F.silu(gate) * up)


def test_empty_batches():
    q, k = qkv_views(0, 4, 2, 32, torch.float32)
    gq, gk = fused.rope(q, k, torch.zeros(0, 32, device=DEVICE))
    assert gq.shape == (0, 4, 32) and gk.shape == (0, 2, 32)
    assert fused.silu_mul(torch.zeros(0, 8, device=DEVICE)).shape == (0, 4)
    empty = torch.zeros(0, 8, device=DEVICE)
    assert fused.rms_norm(empty, torch.ones(8, device=DEVICE), 1e-6).shape == (0, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_rounds_the_sum_like_torch(dtype):
    torch.manual_seed(1)
    weight = torch.empty(896, device=DEVICE).uniform_(0.5, 1.5).to(dtype)
    x, residual = (torch.randn(9, 896, device=DEVICE).to(dtype) * 3 for _ in range(2))
    out, res = fused.add_rms_norm(x, residual, weight, 1e-6)
    check(res, x + residual)
    # the interpreter's bf16 rounding may put the sum an ulp off; normalise the kernel's own sum there
    exact_sum = DEVICE == "cuda" or dtype != torch.bfloat16
    check(out, torch_rms_norm(x + residual if exact_sum else res, weight, 1e-6))


# -- the widths of the models users train (scripts/check_fidelity.py: PUBLISHED), on few tokens ------------
def _published():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import check_fidelity

    return check_fidelity.PUBLISHED, check_fidelity.QWEN25_YARN


PUBLISHED, QWEN25_YARN = _published()


def _real_widths():
    shapes = {
        name: (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"],
               c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]))
        for name, c in PUBLISHED.items()
    }  # fmt: skip
    shapes["qwen2.5-14b"] = (5120, 13824, 40, 8, 128)  # the 5120 width (Qwen2.5-14B/32B, Qwen3-14B)
    return shapes


REAL = _real_widths()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(REAL))
def test_norms_and_silu_mul_at_real_widths(name, dtype):
    hidden, inter, hq, hkv, d = REAL[name]
    torch.manual_seed(3)
    weight = torch.empty(hidden, device=DEVICE).uniform_(0.5, 1.5).to(dtype)
    x, residual = (torch.randn(3, hidden, device=DEVICE).to(dtype) * 3 for _ in range(2))
    check(fused.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6))
    out, res = fused.add_rms_norm(x, residual, weight, 1e-5)
    exact_sum = DEVICE == "cuda" or dtype != torch.bfloat16  # see test_add_rms_norm_rounds_the_sum_like_torch
    check(out, torch_rms_norm(x + residual if exact_sum else res, weight, 1e-5))
    q, _ = qkv_views(3, hq, hkv, d, dtype)  # Qwen3's per-head q_norm on a strided view
    head_weight = torch.empty(d, device=DEVICE).uniform_(0.5, 1.5).to(dtype)
    check(fused.rms_norm(q, head_weight, 1e-6), torch_rms_norm(q, head_weight, 1e-6))
    gate_up = torch.randn(2, 2 * inter, device=DEVICE).to(dtype) * 4
    gate, up = gate_up.split(inter, dim=-1)
    check(fused.silu_mul(gate_up), F.silu(gate) * up)


ROPE_MODELS = ["qwen2.5-0.5b", "qwen2.5-7b", "qwen3-8b", "llama-3.1-8b", "qwen2.5-7b+yarn"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ROPE_MODELS)
def test_rope_at_real_heads_with_the_real_table(name, dtype):
    """The model's own RoPE table (llama3, yarn with its cos/sin factor) at positions past the native
    context, on the real head counts (GQA groups 7 and 4) and head dims."""
    from rollout.models.config import ModelConfig

    cfg = dict(PUBLISHED[name.removesuffix("+yarn")])
    if name.endswith("+yarn"):
        cfg["rope_scaling"] = QWEN25_YARN
    mc = ModelConfig.from_dict(cfg)
    rotary = Rotary(mc.head_dim, mc.max_position_embeddings, device=DEVICE, hf_config=mc.hf_config)
    last = mc.max_position_embeddings - 1
    positions = torch.tensor(sorted({0, 1, 8191, 8192, 32767, min(32768, last), last}), device=DEVICE)
    cos_sin = rotary.cos_sin[positions]
    torch.manual_seed(4)
    q, k = qkv_views(len(positions), mc.num_heads, mc.num_kv_heads, mc.head_dim, dtype)
    gq, gk = fused.rope(q, k, cos_sin)
    check(gq, rope(q, cos_sin))
    check(gk, rope(k, cos_sin))


# -- Qwen3.5's zero-centred norm: x_hat * (1 + w) in float32, one rounding ----------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centred_norm_matches_the_models_torch_code(dtype):
    """The fused kernels with centred=True against ZeroCentredRMSNorm's torch path, at the Qwen3.5 widths:
    rows of the hidden size (2048), q/k heads of 256 as strided views of the gated q projection, and the
    residual add before the norm."""
    from rollout.models.qwen3_5 import ZeroCentredRMSNorm

    torch.manual_seed(3)
    norm = ZeroCentredRMSNorm(2048, 1e-6, dtype=dtype, device=DEVICE)
    heads = ZeroCentredRMSNorm(256, 1e-6, dtype=dtype, device=DEVICE)
    for n in (norm, heads):  # zero-centred weights sit around 0 (the scale is 1 + w)
        n.weight.data.copy_(torch.randn(n.weight.shape, device=DEVICE).mul(0.1).to(dtype))
    x, residual = (torch.randn(7, 2048, device=DEVICE).to(dtype) * 3 for _ in range(2))

    def reference(n, t):  # the torch path (forward off CUDA)
        h = t.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + n.eps)
        return (h * (1.0 + n.weight.float())).to(t.dtype)

    check(fused.rms_norm(x, norm.weight, 1e-6, centred=True), reference(norm, x))
    out, res = fused.add_rms_norm(x, residual, norm.weight, 1e-6, centred=True)
    check(res, x + residual)
    exact_sum = DEVICE == "cuda" or dtype != torch.bfloat16  # see test_add_rms_norm_rounds_the_sum_like_torch
    check(out, reference(norm, x + residual if exact_sum else res))
    q, _gate = torch.randn(5, 8, 2 * 256, device=DEVICE).to(dtype).chunk(2, dim=-1)  # [T, H, D] strided
    check(fused.rms_norm(q, heads.weight, 1e-6, centred=True), reference(heads, q))
    if DEVICE == "cuda":  # the module takes the fused path there
        check(norm(x), reference(norm, x))
        check(norm(x, residual)[0], reference(norm, x + residual))
