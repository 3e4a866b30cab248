"""The fused MoE Triton pipeline (layers/moe_kernels.py) against the torch reference (layers/moe.py).

Without CUDA the kernels run in the Triton interpreter; the real-width case (Qwen3-30B-A3B: hidden 2048,
expert width 768, 128 experts, top-8) keeps the token count small and the blocks large so it stays
quick there. Padding rows (`valid`) and unrouted entries (-1) must cost nothing and contribute zero.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from rollout.layers import moe_kernels  # noqa: E402
from rollout.layers.moe import MoeSpec, Router, experts_reference, top_k_route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(T: int, H: int, I: int, E: int, K: int, dtype: torch.dtype, seed: int = 0):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEVICE, dtype)
    down = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE, dtype)
    weights, ids = top_k_route(torch.randn(T, E, generator=g).to(DEVICE, dtype), K, True)
    return h, gate_up, down, weights, ids


def reference(h, gate_up, down, weights, ids, valid=None):
    if valid is not None:
        ids = ids.clone()
        ids[valid:] = -1
    return experts_reference(h.float(), gate_up.float(), down.float(), weights.float(), ids)


def check(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    else:  # the kernel rounds silu(gate) * up once, the float32 reference never: a few ulp of the output
        torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=2e-2)


def tied_logits(T: int, E: int, seed: int) -> torch.Tensor:
    """bfloat16 router logits [T, E], each row with 3 distinct leaders then a group of 2-12 equal
    values: with top-8 the group sits inside the top-k in some rows and straddles its edge in others."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g).clamp(-3, 3)  # below the planted values
    for r in range(T):
        ids = torch.randperm(E, generator=g)
        logits[r, ids[:3]] = torch.tensor([6.0, 5.5, 5.0])
        logits[r, ids[3 : 3 + 2 + r % 11]] = 4.0
    return logits.to(torch.bfloat16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_router_ties_go_to_the_lowest_expert_id_in_any_batch(device):
    """Equal router scores pick the lowest expert ids, as a stable sort does, whether the token is alone
    or in a batch of 64 (torch.topk leaves ties to its kernel: on the CPU it picks other ids)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    logits, K = tied_logits(64, 128, seed=3).to(device), 8
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    stable = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :K]
    assert ((probs == probs.gather(1, stable[:, 3:4])).sum(1) >= 2).all()  # the planted ties survive
    weights, ids = top_k_route(logits, K, True)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), stable)
    for r in range(len(logits)):
        w1, i1 = top_k_route(logits[r : r + 1], K, True)
        assert torch.equal(i1, ids[r : r + 1]) and torch.equal(w1, weights[r : r + 1])


def test_router_equals_transformers_where_no_scores_tie():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
    theirs = Qwen3MoeTopKRouter(cfg)
    g = torch.Generator().manual_seed(4)
    theirs.weight.data = torch.randn(16, 32, generator=g)
    ours = Router(MoeSpec(16, 4, 8, True), 32, dtype=torch.float32)
    ours.weight.data.copy_(theirs.weight.data)
    h = torch.randn(64, 32, generator=g)
    with torch.no_grad():
        _, want_w, want_ids = theirs(h)
        w, ids = ours.route(h)
    assert torch.equal(ids.long(), want_ids) and torch.equal(w, want_w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_shapes_with_ragged_tiles(dtype):
    # widths that are not multiples of the blocks, more entries per expert than one row block
    args = case(T=40, H=80, I=72, E=6, K=3, dtype=dtype, seed=1)
    check(moe_kernels.fused_experts(*args), reference(*args), dtype)


def test_padding_rows_and_unrouted_entries_get_no_expert():
    h, gate_up, down, weights, ids = case(T=9, H=64, I=32, E=8, K=2, dtype=torch.float32, seed=2)
    ids[1, 0] = -1  # one slot routed nowhere
    valid = torch.tensor(6, device=DEVICE)  # rows 6..8: padding of a captured batch
    got = moe_kernels.fused_experts(h, gate_up, down, weights, ids, valid)
    assert (got[6:] == 0).all()
    check(got, reference(h, gate_up, down, weights, ids, valid=6), torch.float32)
    # the padding rows are in no expert's block: the sorted entries hold only routed ones
    sorted_ids, block_expert = moe_kernels.align(ids, 8, 16, valid)
    entries = sorted_ids[sorted_ids < ids.numel()].tolist()
    assert sorted(entries) == sorted(i for i in range(12) if i != 2)
    for b, e in enumerate(block_expert.tolist()):
        rows = [i for i in sorted_ids[b * 16 : (b + 1) * 16].tolist() if i < ids.numel()]
        assert all(ids.view(-1)[i] == e for i in rows)


def test_align_sorts_stably_and_pads_each_expert():
    ids = torch.tensor([[3, 1], [1, 0], [3, 1]], dtype=torch.int32, device=DEVICE)
    sorted_ids, block_expert = moe_kernels.align(ids, 4, 16, None)
    M = ids.numel()
    runs = [r for r in sorted_ids.view(-1, 16).tolist()]
    assert block_expert.tolist()[:3] == [0, 1, 3] and set(block_expert.tolist()[3:]) == {4}
    assert [i for i in runs[0] if i < M] == [3]
    assert [i for i in runs[1] if i < M] == [1, 2, 5]  # entry order kept within an expert
    assert [i for i in runs[2] if i < M] == [0, 4]


@pytest.mark.slow
def test_real_widths_qwen3_30b_a3b():
    # hidden 2048, expert width 768, 128 experts, top-8; 3 tokens of which 2 are real (the interpreter
    # gathers every weight an expert hit holds: about 14 M values an expert)
    h, gate_up, down, weights, ids = case(T=3, H=2048, I=768, E=128, K=8, dtype=torch.float32, seed=3)
    valid = torch.tensor(2, device=DEVICE)
    blocks = None if torch.cuda.is_available() else (16, 128, 128)
    got = moe_kernels.fused_experts(h, gate_up, down, weights, ids, valid, blocks=blocks)
    check(got, reference(h, gate_up, down, weights, ids, valid=2), torch.float32)
    assert (got[2:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 256, 2048])
def test_gpu_bf16_real_widths_and_cuda_graph(T):
    h, gate_up, down, weights, ids = case(T=T, H=2048, I=768, E=128, K=8, dtype=torch.bfloat16, seed=4)
    got = moe_kernels.fused_experts(h, gate_up, down, weights, ids)
    check(got, reference(h, gate_up, down, weights, ids), torch.bfloat16)
    # captured: the same buffers replayed with other inputs and another valid-row count
    valid = torch.tensor(T, device=DEVICE)
    static_h, static_w, static_ids = h.clone(), weights.clone(), ids.clone()
    moe_kernels.fused_experts(static_h, gate_up, down, static_w, static_ids, valid)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_kernels.fused_experts(static_h, gate_up, down, static_w, static_ids, valid)
    h2, _, _, w2, ids2 = case(T=T, H=2048, I=768, E=128, K=8, dtype=torch.bfloat16, seed=5)
    static_h.copy_(h2)
    static_w.copy_(w2)
    static_ids.copy_(ids2)
    valid.fill_(max(T // 2, 1))
    graph.replay()
    n = max(T // 2, 1)
    check(out, reference(h2, gate_up, down, w2, ids2, valid=n), torch.bfloat16)
    assert (out[n:] == 0).all()
