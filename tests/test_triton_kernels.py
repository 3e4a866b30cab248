"""Triton paged attention kernels vs. a plain torch reference.

Without CUDA the kernels run in the Triton interpreter (TRITON_INTERPRET=1), so shapes are kept small.
"""

import gc
import math
import os

import pytest
import torch

# The interpreter must be chosen before triton is first imported (torch does not import it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from rollout.attention import triton_kernels
from rollout.attention.triton_kernels import paged_decode_attention, paged_extend_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------


def make_paged_kv(seq_lens, page_size, num_kv_heads, head_dim, dtype, gen, spare_pages=3):
    """Random cache with each request's pages scattered in shuffled order.

    Unused slots and pages hold random data too, so reading outside a request's tokens shows up as an error.
    Unused page-table entries point at random (valid) pages for the same reason.
    """
    pages_per_req = [math.ceil(n / page_size) for n in seq_lens]
    num_pages = sum(pages_per_req) + spare_pages
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)

    perm = torch.randperm(num_pages, generator=gen)
    max_pages = max(pages_per_req) + 2
    page_table = torch.randint(0, num_pages, (len(seq_lens), max_pages), generator=gen, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_req):
        page_table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return k_cache.to(DEVICE), v_cache.to(DEVICE), page_table.to(DEVICE)


def gather_kv(cache, page_table_row, seq_len):
    # cache: [P, page_size, Hkv, D] -> [seq_len, Hkv, D]
    page_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    return cache[page_table_row[pos // page_size].long(), pos % page_size]


def reference_paged_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, sm_scale):
    """Causal attention in fp64; q: [total_q, Hq, D], the last q_len kv positions are the queries."""
    out = torch.zeros_like(q, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for b in range(len(seq_lens)):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        kv_len, q_len = int(seq_lens[b]), q1 - q0
        if q_len == 0 or kv_len == 0:
            continue
        k = gather_kv(k_cache, page_table[b], kv_len).double().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, page_table[b], kv_len).double().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k) * sm_scale  # [Hq, q_len, kv_len]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        visible = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def assert_close(out, ref, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def run_decode(seq_lens, hq, hkv, head_dim, page_size, dtype, num_kv_splits=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, page_table = make_paged_kv(seq_lens, page_size, hkv, head_dim, dtype, gen)
    q = torch.randn(len(seq_lens), hq, head_dim, generator=gen).to(dtype).to(DEVICE)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    sm_scale = head_dim**-0.5
    out = paged_decode_attention(
        q, k_cache, v_cache, page_table, seq_lens_t, sm_scale, num_kv_splits=num_kv_splits
    )
    cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = reference_paged_attention(q, k_cache, v_cache, page_table, cu, seq_lens_t, sm_scale)
    return out, ref


def run_extend(q_lens, seq_lens, hq, hkv, head_dim, page_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, page_table = make_paged_kv(seq_lens, page_size, hkv, head_dim, dtype, gen)
    q = torch.randn(sum(q_lens), hq, head_dim, generator=gen).to(dtype).to(DEVICE)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    cu = cu.to(DEVICE)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    sm_scale = head_dim**-0.5
    out = paged_extend_attention(
        q, k_cache, v_cache, page_table, cu, seq_lens_t, sm_scale, max_q_len=max(q_lens)
    )
    ref = reference_paged_attention(q, k_cache, v_cache, page_table, cu, seq_lens_t, sm_scale)
    return out, ref


# ---------------------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------------------

# (seq_lens, Hq, Hkv, head_dim, page_size): lengths 1, page_size, page_size + 1, many pages; GQA 1/2/4/8.
DECODE_CASES = [
    ([1, 16, 17, 70], 4, 4, 64, 16),
    ([5, 33, 64], 8, 4, 128, 16),
    ([1, 2, 47], 8, 2, 64, 1),
    ([16, 69], 8, 1, 64, 16),
    ([31, 3], 4, 1, 128, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"L{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-p{c[4]}")
def test_decode_matches_reference(case, dtype):
    seq_lens, hq, hkv, head_dim, page_size = case
    out, ref = run_decode(seq_lens, hq, hkv, head_dim, page_size, dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("num_kv_splits", [1, 3, 16])
def test_decode_num_kv_splits(num_kv_splits):
    # 16 splits of >= 64 tokens each leave most splits empty for these lengths.
    out, ref = run_decode([1, 40, 70], 4, 2, 64, 16, torch.float32, num_kv_splits=num_kv_splits)
    assert_close(out, ref, torch.float32)


def test_decode_padding_rows_are_zero():
    # A padded CUDA-graph batch has seq_len 0 rows: they must come out as zeros, not NaN.
    out, ref = run_decode([0, 20, 0, 1], 4, 2, 64, 16, torch.float32)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all() and (out[2] == 0).all()
    assert_close(out, ref, torch.float32)


def poisoned(cache, page_table, seq_lens):
    """`cache` with NaN in every slot no request owns: past each length, in unused pages and in the
    pages unused page-table entries point at."""
    page_size = cache.shape[1]
    owned = torch.zeros(cache.shape[:2], dtype=torch.bool, device=cache.device)
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n, device=cache.device)
        owned[page_table[b, pos // page_size].long(), pos % page_size] = True
    return cache.masked_fill(~owned[:, :, None, None], float("nan"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stale_nan_outside_the_requests_never_reaches_outputs(dtype):
    """Masking scores is not enough (0 * NaN is NaN): slots past a length must never be loaded."""
    seq_lens, q_lens = [1, 5, 17, 30], [1, 3, 17, 8]
    gen = torch.Generator().manual_seed(3)
    k, v, table = make_paged_kv(seq_lens, 4, 2, 16, dtype, gen)
    bad_k, bad_v = poisoned(k, table, seq_lens), poisoned(v, table, seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), 4, 16, generator=gen).to(dtype).to(DEVICE)
    for splits in (1, 3, 8):
        clean = paged_decode_attention(q, k, v, table, lens, 0.25, num_kv_splits=splits)
        assert torch.equal(
            paged_decode_attention(q, bad_k, bad_v, table, lens, 0.25, num_kv_splits=splits), clean
        )
    q = torch.randn(sum(q_lens), 4, 16, generator=gen).to(dtype).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    clean = paged_extend_attention(q, k, v, table, cu, lens, 0.25, max_q_len=max(q_lens))
    assert torch.isfinite(clean).all()
    assert torch.equal(
        paged_extend_attention(q, bad_k, bad_v, table, cu, lens, 0.25, max_q_len=max(q_lens)), clean
    )


def test_decode_writes_into_out_and_strided_q():
    gen = torch.Generator().manual_seed(1)
    seq_lens, hq, hkv, d = [9, 25], 4, 2, 64
    k_cache, v_cache, page_table = make_paged_kv(seq_lens, 16, hkv, d, torch.float32, gen)
    # q as a strided view into a fused qkv buffer, like the engine's projection output.
    qkv = torch.randn(2, hq + 2 * hkv, d, generator=gen).to(DEVICE)
    q = qkv[:, :hq]
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    res = paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens_t, 0.1, out=out)
    assert res is out
    cu = torch.arange(3, dtype=torch.int32, device=DEVICE)
    ref = reference_paged_attention(q, k_cache, v_cache, page_table, cu, seq_lens_t, 0.1)
    assert_close(out, ref, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Extend / prefill
# ---------------------------------------------------------------------------------------------------------

# (q_lens, seq_lens, Hq, Hkv, head_dim, page_size)
EXTEND_CASES = [
    # pure prefill: q_len == seq_len, incl. lengths 1, page_size, page_size + 1
    ([1, 16, 17, 70], [1, 16, 17, 70], 4, 4, 64, 16),
    # cached prefix: q_len < seq_len, incl. single new token and chunks crossing page boundaries
    ([1, 20, 5], [40, 37, 5], 8, 2, 128, 16),
    ([3, 66], [50, 70], 8, 1, 64, 1),
    ([7, 1, 33], [7, 18, 64], 8, 4, 64, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "case", EXTEND_CASES, ids=lambda c: f"q{c[0]}-L{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-p{c[5]}"
)
def test_extend_matches_reference(case, dtype):
    q_lens, seq_lens, hq, hkv, head_dim, page_size = case
    out, ref = run_extend(q_lens, seq_lens, hq, hkv, head_dim, page_size, dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, dtype)


def test_extend_max_q_len_larger_than_needed_and_strided_q():
    # The caller may round max_q_len up (e.g. a bucketed grid); extra query blocks must be no-ops.
    gen = torch.Generator().manual_seed(2)
    q_lens, seq_lens, hq, hkv, d = [3, 5], [10, 5], 4, 2, 64
    k_cache, v_cache, page_table = make_paged_kv(seq_lens, 16, hkv, d, torch.float32, gen)
    # q as a strided view into a fused qkv buffer.
    q = torch.randn(sum(q_lens), hq + 2 * hkv, d, generator=gen).to(DEVICE)[:, :hq]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    res = paged_extend_attention(
        q, k_cache, v_cache, page_table, cu, seq_lens_t, 0.125, out=out, max_q_len=200
    )
    assert res is out
    ref = reference_paged_attention(q, k_cache, v_cache, page_table, cu, seq_lens_t, 0.125)
    assert_close(out, ref, torch.float32)


def test_extend_single_token_matches_decode():
    # An extend with q_len 1 per request is a decode step: both kernels must agree.
    gen = torch.Generator().manual_seed(3)
    seq_lens, hq, hkv, d = [1, 17, 45], 8, 2, 64
    k_cache, v_cache, page_table = make_paged_kv(seq_lens, 16, hkv, d, torch.float32, gen)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(DEVICE)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ext = paged_extend_attention(q, k_cache, v_cache, page_table, cu, seq_lens_t, 0.125, max_q_len=1)
    dec = paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens_t, 0.125)
    torch.testing.assert_close(ext, dec, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Both kernels: other head dims and tile sizes
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 32, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_head_dims(head_dim, dtype):
    out, ref = run_decode([1, 17, 40], 4, 2, head_dim, 16, dtype)
    assert_close(out, ref, dtype)
    out, ref = run_extend([5, 17], [40, 17], 4, 2, head_dim, 16, dtype)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_tiles(monkeypatch, dtype):
    # Tiles smaller than a page and many query/kv blocks per request stress the block bookkeeping
    # (unmasked vs. diagonal kv blocks, split boundaries) that the default tiles barely reach here.
    monkeypatch.setattr(triton_kernels, "_decode_config", lambda head_dim, dtype: (16, 4))
    monkeypatch.setattr(triton_kernels, "_extend_config", lambda head_dim, dtype, max_q_len: (16, 16, 4))
    out, ref = run_decode([1, 15, 16, 17, 70], 4, 2, 64, 16, dtype, num_kv_splits=3)
    assert_close(out, ref, dtype)
    out, ref = run_extend([1, 33, 70, 16], [17, 60, 70, 16], 4, 2, 64, 16, dtype)
    assert_close(out, ref, dtype)


# ---------------------------------------------------------------------------------------------------------
# GPU-only: realistic sizes (too slow for the interpreter)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_large_gpu(head_dim, dtype):
    seq_lens = [1, 16, 17, 511, 2049, 4000, 0, 777]
    out, ref = run_decode(seq_lens, 32, 8, head_dim, 16, dtype, num_kv_splits=16)
    assert_close(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_extend_large_gpu(head_dim, dtype):
    q_lens = [1, 300, 1024, 17]
    seq_lens = [900, 300, 2000, 33]
    out, ref = run_extend(q_lens, seq_lens, 32, 8, head_dim, 16, dtype)
    assert_close(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_cuda_graph_replay():
    # Capture once, then change seq_lens/page_table in place: replay must follow the new values.
    gen = torch.Generator().manual_seed(4)
    hq, hkv, d, page_size = 16, 4, 128, 16
    max_lens = [300, 300, 300, 300]
    k_cache, v_cache, page_table = make_paged_kv(max_lens, page_size, hkv, d, torch.bfloat16, gen)
    q = torch.randn(4, hq, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    seq_lens_t = torch.tensor([1, 1, 1, 1], dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)

    def step():
        paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens_t, d**-0.5, out=out)

    step()  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([5, 0, 300, 17], [299, 64, 1, 0]):
        seq_lens_t.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        cu = torch.arange(5, dtype=torch.int32, device=DEVICE)
        ref = reference_paged_attention(q, k_cache, v_cache, page_table, cu, seq_lens_t, d**-0.5)
        assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_page_offsets_beyond_int32_gpu():
    # page * page_stride > 2**31 elements: offsets must be computed in int64 (needs ~8.6 GB of cache).
    gc.collect()  # engines of earlier tests may still hold the device
    torch.cuda.empty_cache()
    page_size, hkv, hq, d = 16, 1, 4, 64
    num_pages = 2**31 // (page_size * hkv * d) + 64
    k_cache = torch.empty(num_pages, page_size, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    seq_lens = [40, 17]
    gen = torch.Generator().manual_seed(5)
    page_table = torch.zeros(2, 4, dtype=torch.int32)
    page_table[0, :3] = torch.tensor([num_pages - 1, 7, num_pages - 30])
    page_table[1, :2] = torch.tensor([num_pages - 2, 3])
    page_table = page_table.to(DEVICE)
    for p in page_table.flatten().tolist():
        k_cache[p] = torch.randn(page_size, hkv, d, generator=gen).to(torch.bfloat16).to(DEVICE)
        v_cache[p] = torch.randn(page_size, hkv, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, hq, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    cu = torch.arange(3, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens_t, d**-0.5)
    ref = reference_paged_attention(q, k_cache, v_cache, page_table, cu, seq_lens_t, d**-0.5)
    assert_close(out, ref, torch.bfloat16)
    out = paged_extend_attention(q, k_cache, v_cache, page_table, cu, seq_lens_t, d**-0.5, max_q_len=1)
    assert_close(out, ref, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# The head counts and head dims of the models users train, on few tokens (interpreter-sized)
# ---------------------------------------------------------------------------------------------------------

# (model, Hq, Hkv, head_dim): GQA groups 7, 6, 2, 4 and 5 at head dims 64 and 128
REAL_HEADS = [
    ("qwen2.5-0.5b", 14, 2, 64),
    ("qwen2.5-1.5b", 12, 2, 128),
    ("qwen2.5-7b", 28, 4, 128),
    ("qwen3-0.6b", 16, 8, 128),
    ("qwen3-8b/llama-3.1-8b/mistral-7b", 32, 8, 128),
    ("qwen2.5-14b", 40, 8, 128),
]


# float32 for every shape, bfloat16 for three (GQA 7, 7, 4): the interpreter runs a program per head
REAL_CASES = [(c, torch.float32) for c in REAL_HEADS] + [(c, torch.bfloat16) for c in REAL_HEADS[::2]]
REAL_IDS = [f"{c[0]}-{str(dtype).removeprefix('torch.')}" for c, dtype in REAL_CASES]


@pytest.mark.parametrize("case, dtype", REAL_CASES, ids=REAL_IDS)
def test_real_head_shapes(case, dtype):
    _, hq, hkv, d = case
    out, ref = run_decode([1, 40], hq, hkv, d, 16, dtype)  # one page and several
    assert_close(out, ref, dtype)
    out, ref = run_extend([3, 17], [40, 17], hq, hkv, d, 16, dtype)  # behind a cached prefix, and fresh
    assert_close(out, ref, dtype)
