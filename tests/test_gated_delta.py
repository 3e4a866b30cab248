"""The gated delta rule and short conv kernels (rollout/layers/gated_delta.py, short_conv.py) against the
token-by-token definition and transformers' torch fallbacks (Qwen3.5), on random inputs: chunked
prefill continuing across chunk boundaries that fall off the kernel's chunk size, decode in place in a
pool of slots, and the Triton decode kernel (interpreted on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rollout.layers import gated_delta, short_conv

HK, HV, DK, DV = 2, 4, 16, 8


def inputs(T, seed=0, hk=HK, hv=HV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, hk, DK, generator=g)
    k = torch.randn(T, hk, DK, generator=g)
    v = torch.randn(T, hv, DV, generator=g)
    a = torch.randn(T, hv, generator=g)
    decay = -torch.rand(hv, generator=g).exp() * F.softplus(a)  # as the model computes g
    beta = torch.rand(T, hv, generator=g)
    return q, k, v, decay, beta


def test_chunked_equals_recurrent_and_transformers():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    q, k, v, g, beta = inputs(150)
    s0 = torch.randn(HV, DK, DV)
    o_ref, s_ref = gated_delta.recurrent_reference(q, k, v, g, beta, s0)
    qp, kp = gated_delta.prepare(q, k, HV)
    o, s = gated_delta.chunked_one(qp, kp, v, g, beta, s0)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)
    # the torch function itself: transformers 5.17 wraps it to call fla when installed, CPU inputs too
    torch_rule = getattr(hf.torch_chunk_gated_delta_rule, "__wrapped__", hf.torch_chunk_gated_delta_rule)
    o_hf, s_hf = torch_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=s0[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(o, o_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_hf[0], atol=1e-5, rtol=1e-5)


def test_prefill_in_steps_continues_exactly():
    """Two requests prefilled in pieces of 37, 70 and 43 tokens (off the chunk size 64), then 3 decode
    steps, against one pass of the definition."""
    T, extra = 150, 3
    reqs = [inputs(T + extra, seed=s) for s in (1, 2)]
    pool = torch.full((5, HV, DK, DV), float("nan"))  # stale slots must not leak into fresh requests
    slots = torch.tensor([3, 1])
    start = 0
    for piece in (37, 70, 43):
        cat = [torch.cat([r[i][start : start + piece] for r in reqs]) for i in range(5)]
        fresh = torch.tensor([start == 0] * 2)
        out = gated_delta.prefill(*cat, pool, slots, fresh, [piece, piece])
        for b, r in enumerate(reqs):
            ref, _ = gated_delta.recurrent_reference(
                *(x[: start + piece] for x in r), torch.zeros(HV, DK, DV)
            )
            torch.testing.assert_close(out[b * piece : (b + 1) * piece], ref[start:], atol=1e-5, rtol=1e-5)
        start += piece
    for t in range(T, T + extra):
        step = [torch.stack([r[i][t] for r in reqs]) for i in range(5)]
        out = gated_delta.decode(*step, pool, slots)
        for b, r in enumerate(reqs):
            ref, s = gated_delta.recurrent_reference(*(x[: t + 1] for x in r), torch.zeros(HV, DK, DV))
            torch.testing.assert_close(out[b], ref[t], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(pool[slots[b]], s, atol=1e-5, rtol=1e-5)


def test_triton_decode_kernel_interpreted():
    pytest.importorskip("triton")
    from rollout.layers.gated_delta_kernels import decode_step

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    B = 3
    q, k, v, g, beta = (x.to(dev) for x in inputs(B, seed=5))
    pool = torch.randn(6, HV, DK, DV, device=dev)
    slots = torch.tensor([4, 0, 2], device=dev)
    ref_pool = pool.clone()
    ref = gated_delta.decode_torch(q, k, v, g, beta, ref_pool, slots)
    out = decode_step(q, k, v, g, beta, pool, slots)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)


def test_short_conv_prefill_then_decode_matches_transformers():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    C, K, T = 12, 4, 9
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(C, K, generator=gen)
    xs = [torch.randn(T + 2, C, generator=gen) for _ in range(2)]
    pool = torch.full((4, C, K - 1), float("nan"))
    slots = torch.tensor([2, 0])
    outs = []
    start = 0
    for piece in (2, 7):  # the first piece is shorter than the state: old state rows stay in it
        chunk = torch.cat([x[start : start + piece] for x in xs])
        outs.append(
            short_conv.prefill(chunk, weight, pool, slots, torch.tensor([start == 0] * 2), [piece] * 2)
        )
        start += piece
    dec = [short_conv.decode(torch.stack([x[t] for x in xs]), weight, pool, slots) for t in (T, T + 1)]
    for b, x in enumerate(xs):
        ref = hf.causal_conv1d_fn(x.T[None], weight, activation="silu")[0].T  # [T+2, C]
        got = torch.cat(
            [outs[0][b * 2 : b * 2 + 2], outs[1][b * 7 : b * 7 + 7], dec[0][b : b + 1], dec[1][b : b + 1]]
        )
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_kernel_captured_in_a_cuda_graph():
    from rollout.layers.gated_delta_kernels import decode_step

    q, k, v, g, beta = (x.cuda() for x in inputs(4, seed=7))
    pool = torch.randn(8, HV, DK, DV, device="cuda")
    slots = torch.tensor([1, 3, 5, 7], device="cuda")
    ref_pool = pool.clone()
    decode_step(q, k, v, g, beta, pool.clone(), slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_step(q, k, v, g, beta, pool, slots)
    graph.replay()
    ref = gated_delta.decode_torch(q, k, v, g, beta, ref_pool, slots)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_prefill_matches_reference():
    if not gated_delta.fla_available():
        pytest.skip("flash-linear-attention is not installed")
    lens = [100, 37, 200]
    q, k, v, g, beta = (x.cuda() for x in inputs(sum(lens), seed=9))
    pool = torch.randn(4, HV, DK, DV, device="cuda")
    slots = torch.tensor([0, 2, 3], device="cuda")
    fresh = torch.tensor([True, False, False], device="cuda")
    cu = torch.tensor([0, 100, 137, 337], device="cuda", dtype=torch.int32)
    ref_pool = pool.clone()
    out = gated_delta.prefill(q, k, v, g, beta, pool, slots, fresh, lens, cu)
    ref = gated_delta.prefill(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), ref_pool.cpu(), slots.cpu(),
                              fresh.cpu(), lens)  # fmt: skip
    torch.testing.assert_close(out.cpu(), ref, atol=2e-3, rtol=2e-3)
