"""The fused log-softmax kernel (softmax_kernel.py) against torch: the scaled logprobs, the padded probs
and the sampling kernel's block weights; bf16 logits; a row's bits whatever the batch; the draw through
it against the sort-based reference; and `sample()` on its CUDA path (here in the Triton interpreter).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from test_sampler_exact import CASES, QWEN_VOCAB, make_logits  # noqa: E402

from rollout import SamplingParams  # noqa: E402
from rollout.layers.topk import topk_lowest_index_first  # noqa: E402
from rollout.runner import sample_kernel, sampler, softmax_kernel  # noqa: E402
from rollout.runner.sampler import SamplingBatch, sample  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fused(logits: torch.Tensor, scale: torch.Tensor):
    """The kernel as sample() calls it: logprobs, probs padded to CDF_BLOCK, the sampling blocks' sums."""
    V = logits.shape[1]
    cfg = sample_kernel.launch_config(V)
    return softmax_kernel.log_softmax_rows(logits, scale, sampler._padded(V), cfg["BLOCK"], cfg["NB"])


def rows(N: int, V: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=gen) * torch.linspace(1, 6, N).unsqueeze(1)
    x[0, : V // 3] = float("-inf")  # masked tokens (min_tokens, a -inf logit_bias)
    scale = torch.tensor([1.0, 0.7, 1.3, 0.25, 2.0, 1.0][:N])
    return x.to(DEVICE), scale.to(DEVICE)


def block_sums(probs: torch.Tensor, V: int) -> torch.Tensor:
    """Each sampling-kernel block's fixed-point weight, in torch."""
    cfg = sample_kernel.launch_config(V)
    B, N = cfg["BLOCK"], probs.shape[0]
    w = sampler._fixed(probs[:, :V])
    want = torch.zeros(N, cfg["NB"], dtype=torch.int64, device=probs.device)
    for b in range(-(-V // B)):
        want[:, b] = w[:, b * B : (b + 1) * B].sum(dim=1)
    return want


def assert_matches_torch(x: torch.Tensor, scale: torch.Tensor) -> None:
    V = x.shape[1]
    lp, probs, sums = fused(x, scale)
    want = torch.log_softmax(x.double() / scale.double().unsqueeze(1), dim=-1)
    assert torch.equal(lp.isneginf(), want.isneginf())
    finite = want.isfinite()
    torch.testing.assert_close(lp[finite].double(), want[finite], rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(probs[:, :V].double(), want.exp(), rtol=2e-5, atol=1e-9)
    assert probs.shape[1] == sampler._padded(V) and not probs[:, V:].any(), "padding not zero"
    assert torch.equal(sums, block_sums(probs, V))  # of the stored probs, exactly


@pytest.mark.parametrize("V", [8, 1000, 2100, 5000])
def test_matches_torch(V):
    assert_matches_torch(*rows(6, V, seed=V))


def test_matches_torch_at_qwen_vocab():
    x, scale = rows(3, QWEN_VOCAB, seed=1)
    assert_matches_torch(x, scale)
    assert_matches_torch(x.to(torch.bfloat16), scale)


def test_small_blocks_match_torch(monkeypatch):
    """Blocks of 128 (the sampling kernel's too): 40 blocks of sums, a padding wider than a block."""
    monkeypatch.setattr(sample_kernel, "BLOCK", 128)
    assert sample_kernel.launch_config(5000)["BLOCK"] == 128
    assert_matches_torch(*rows(4, 5000, seed=2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_read_as_their_float32_cast(dtype):
    x, scale = rows(4, 3000, seed=3)
    x = x.to(dtype)
    for got, want in zip(fused(x, scale), fused(x.float(), scale)):
        assert torch.equal(got, want)


def test_row_is_batch_invariant():
    x, scale = rows(6, 3000, seed=5)
    for at in range(6):
        alone = fused(x[at : at + 1], scale[at : at + 1])
        for got, want in zip(fused(x, scale), alone):
            assert torch.equal(got[at : at + 1], want), at
    big, big_scale = rows(6, 3000, seed=6)
    big[2], big_scale[2] = x[4], scale[4]  # the same row among other rows
    for got, want in zip(fused(big, big_scale), fused(x, scale)):
        assert torch.equal(got[2], want[4])


# -- the draw through it ---------------------------------------------------------------------------------
def draw_batch(kind: str, V: int, seed: int, cases=CASES):
    logits = make_logits(kind, len(cases), V, seed).to(DEVICE)
    us = torch.rand(len(cases), dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    sb = SamplingBatch.build(list(cases), us.tolist(), V, torch.device(DEVICE))
    scale = torch.where(sb.temperatures == 0, torch.ones_like(sb.temperatures), sb.temperatures)
    return logits, scale, sb


@pytest.mark.parametrize("kind", ["flat", "peaked", "tied"])
def test_kernel_draw_through_it_equals_the_sort(monkeypatch, kind):
    """Given the fused probs and block sums, the sampling kernel draws what the sort-based reference
    draws from the same probs: rows without truncation through the sums, the others in full. Blocks
    of 128: 17 of them to a row."""
    monkeypatch.setattr(sample_kernel, "BLOCK", 128)
    cases = [p for p in CASES if p.top_k <= 1000] + [SamplingParams(temperature=t) for t in (0.6, 1.0, 1.7)]
    logits, scale, sb = draw_batch(kind, 2100, seed=7, cases=cases)
    lp, probs, sums = fused(logits, scale)
    want_tokens, want_weights = sampler.sort_draw(lp, sb, probs)
    tokens, cuts = sample_kernel.sample_rows(probs, 2100, sb.top_k, sb.top_p, sb.min_p, sb.uniforms, sums)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(sampler._kept_weights(probs, 2100, cuts, sb), want_weights())


def test_block_sums_serve_only_rows_without_truncation(monkeypatch):
    """Block weights that put all the mass in the last block: a row without truncation draws there (the
    kernel read them instead of the row), a truncated row ignores them."""
    monkeypatch.setattr(sample_kernel, "BLOCK", 128)
    params = [SamplingParams(), SamplingParams(top_p=0.9), SamplingParams(top_k=5), SamplingParams(min_p=0.1)]
    logits, scale, sb = draw_batch("peaked", 1000, seed=8, cases=params)
    lp, probs, sums = fused(logits, scale)
    fake = torch.zeros_like(sums)
    fake[:, 7] = 1 << 52  # block 7: tokens 896..999
    args = (probs, 1000, sb.top_k, sb.top_p, sb.min_p, sb.uniforms)
    tokens, _ = sample_kernel.sample_rows(*args, fake)
    want, _ = sample_kernel.sample_rows(*args)
    assert 896 <= tokens[0] < 1000 and not (896 <= want[0] < 1000)
    assert torch.equal(tokens[1:], want[1:])


# -- sample() on its CUDA path --------------------------------------------------------------------------
@pytest.fixture
def triton_path(monkeypatch):
    """sample() as on CUDA: the fused kernel and the sampling kernel, on this machine's tensors."""
    monkeypatch.setattr(sampler, "_triton", lambda t: True)
    calls = []
    real = softmax_kernel.log_softmax_rows
    spy = lambda x, *a: calls.append(x.dtype) or real(x, *a)  # noqa: E731
    monkeypatch.setattr(softmax_kernel, "log_softmax_rows", spy)
    return calls


MIXED = [
    SamplingParams(temperature=0, logprobs=True),
    SamplingParams(),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(top_k=20, min_p=0.02, temperature=1.3, logprobs=True, top_logprobs=3),
    SamplingParams(temperature=0),
]


def test_sample_on_the_triton_path(triton_path):
    logits, scale, sb = draw_batch("bf16", 3000, seed=9, cases=MIXED)
    res = sample(logits, sb)
    assert triton_path == [torch.float32]
    lp, probs, sums = fused(logits, scale)
    want_tokens, _ = sampler.sort_draw(lp, sb, probs)
    greedy = sb.temperatures == 0
    assert torch.equal(res.tokens, torch.where(greedy, logits.argmax(dim=-1), want_tokens))
    torch_lp = torch.log_softmax(logits / scale.unsqueeze(1), dim=-1)
    torch.testing.assert_close(res.logprobs, torch_lp.gather(1, res.tokens.unsqueeze(1)).squeeze(1))
    want_top = topk_lowest_index_first(lp, 3)
    assert torch.equal(res.top_ids, want_top[1]) and torch.equal(res.top_logprobs, want_top[0])


def test_sample_greedy_row_is_batch_invariant_on_the_triton_path(triton_path):
    """A greedy row reports the same logprob bits in an all-greedy batch (no draw) as beside sampled
    rows (the kernel writes the same outputs either way)."""
    greedy = SamplingParams(temperature=0, logprobs=True)
    logits, _, sb = draw_batch("flat", 3000, seed=10, cases=[greedy] * 3)
    alone = sample(logits, sb)
    assert sb.all_greedy and torch.equal(alone.tokens, logits.argmax(dim=-1))
    torch.testing.assert_close(alone.logprobs, torch.log_softmax(logits, -1).max(dim=-1).values)
    mixed_logits, _, mixed = draw_batch("flat", 3000, seed=15, cases=MIXED)
    mixed_logits[0] = logits[1]
    got = sample(mixed_logits, mixed)
    assert got.tokens[0] == alone.tokens[1] and torch.equal(got.logprobs[0], alone.logprobs[1])
    assert len(triton_path) == 2


def test_sample_without_greedy_rows_skips_the_argmax(triton_path, monkeypatch):
    logits, _, sb = draw_batch("flat", 2100, seed=11, cases=[SamplingParams(), SamplingParams(top_p=0.8)])
    assert not sb.any_greedy
    monkeypatch.setattr(torch.Tensor, "argmax", lambda *a, **k: pytest.fail("argmax taken"))
    sample(logits, sb)


def test_sample_bf16_logits_as_their_float32_cast(triton_path):
    logits, _, sb = draw_batch("flat", 3000, seed=12, cases=MIXED)
    logits = (logits * 3).to(torch.bfloat16)
    got, want = sample(logits, sb), sample(logits.float(), sb)
    for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_sample_adjusted_and_processed_on_the_triton_path(triton_path):
    """min_tokens (EOS, token 5, masked with -inf), a bias and processed logprobs: the torch path's."""
    from rollout.runner.logit_adjust import LogitAdjust
    from rollout.state.sequence import Sequence

    V = 2100
    params = [
        SamplingParams(min_tokens=2, logit_bias={9: 3.0}, logprobs=True),
        SamplingParams(top_p=0.8, logprobs=True, logprobs_mode="processed"),
        SamplingParams(temperature=0, logit_bias={7: 50.0}, logprobs=True),
    ]
    logits, _, sb = draw_batch("peaked", V, seed=13, cases=params)
    seqs = [Sequence(i, 0, 0, [1, 2], 2, p, i) for i, p in enumerate(params)]
    sb.adjust = LogitAdjust.build(seqs, [5], V, torch.device(DEVICE))
    assert sb.adjusts_logits
    got = sample(logits, sb)
    assert triton_path == [torch.float32]
    assert got.tokens[2] == 7 and got.tokens[0] != 5
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler, "_triton", lambda t: False)
        want = sample(logits, sb)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logprobs, want.logprobs)


# -- on a GPU -------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["flat", "peaked", "bf16", "tied"])
def test_sample_at_qwen_vocab_gpu(kind):
    """sample() on CUDA as the runner calls it: the fused kernel, block sums, the sampling kernel."""
    cases = CASES * 7 + [SamplingParams(temperature=t) for t in (0.5, 1.0, 1.0, 1.5)] * 5
    logits, scale, sb = draw_batch(kind, QWEN_VOCAB, seed=14, cases=cases)
    res = sample(logits, sb)
    lp, probs, _ = fused(logits, scale)
    assert torch.equal(res.tokens, sampler.sort_draw(lp, sb, probs)[0])
    want = torch.log_softmax(logits / scale.unsqueeze(1), dim=-1)
    torch.testing.assert_close(lp, want, rtol=1e-5, atol=5e-5)
    bf16 = sample(logits.to(torch.bfloat16), sb)
    assert torch.equal(bf16.tokens, sample(logits.to(torch.bfloat16).float(), sb).tokens)
