"""The sort-free sampling paths against the sort-based reference (sampler.sort_draw, the sampler before
issue #15): the same truncation set, the same weights and the same token for every row, at Qwen's
vocabulary, through ties, and whatever the batch around a row.

Two paths: the torch one (topk candidates, the CPU) and the Triton kernel (CUDA; here in the Triton
interpreter on small vocabularies, since it is slow there).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton_interp import skip_repatching  # noqa: E402

from rollout import SamplingParams  # noqa: E402
from rollout.runner import sampler  # noqa: E402
from rollout.runner.sampler import SamplingBatch, sample  # noqa: E402

QWEN_VOCAB = 151936
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernel runs
CASES = [
    SamplingParams(top_p=0.95),
    SamplingParams(top_p=0.5, temperature=0.7),
    SamplingParams(top_k=50),
    SamplingParams(top_k=50, top_p=0.9),
    SamplingParams(top_k=3000, top_p=0.99),  # top_k above the torch path's candidates, below the vocabulary
    SamplingParams(top_k=1),
    SamplingParams(min_p=0.05),  # no top-k / top-p
    SamplingParams(top_p=0.9, min_p=0.1),
    SamplingParams(top_k=20, top_p=0.8, min_p=0.02, temperature=1.3),
    SamplingParams(),  # top_p=1, top_k=-1
]


def make_logits(kind: str, rows: int, V: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=gen)
    if kind == "flat":  # a randomly initialised model: top_p=0.95 keeps most of the vocabulary
        return x
    if kind == "peaked":  # a few hundred tokens hold the mass
        return x * 5
    if kind == "bf16":  # bf16 logits: many exact ties, some across the cuts
        return (x * 3).to(torch.bfloat16).float()
    assert kind == "tied"
    x = torch.full((rows, V), -6.0)  # groups of exactly equal logits straddling every cut
    x[:, 100:600] = 0.0
    x[:, [3, V // 3, V // 2, V - 1]] = 2.0
    x[:, [4, 1024, V // 2 + 7, V - 2]] = 1.0
    return x


def batch(kind: str, V: int, seed: int = 0, cases=CASES, device="cpu"):
    logits = make_logits(kind, len(cases), V, seed).to(device)
    us = torch.rand(len(cases), dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    return logits, SamplingBatch.build(list(cases), us.tolist(), V, torch.device(device))


def logprobs_of(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    greedy = sb.temperatures == 0
    scale = torch.where(greedy, torch.ones_like(sb.temperatures), sb.temperatures).unsqueeze(1)
    return torch.log_softmax(logits / scale, dim=-1)


def assert_same_as_reference(logits: torch.Tensor, sb: SamplingBatch) -> None:
    lp = logprobs_of(logits, sb)
    want_tokens, want_weights = sampler.sort_draw(lp, sb)
    tokens, weights = sampler._draw(lp, sb)
    got, want = weights(), want_weights()
    assert torch.equal(got > 0, want > 0), "truncation sets differ"
    assert torch.equal(got, want)
    assert torch.equal(tokens, want_tokens)


# -- the torch path (this machine's) ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["flat", "peaked", "bf16", "tied"])
def test_torch_path_equals_the_sort_at_qwen_vocab(kind):
    assert_same_as_reference(*batch(kind, QWEN_VOCAB))


def test_torch_path_decides_most_peaked_rows_without_the_sort(monkeypatch):
    """The candidates, not the fallback sort, decide peaked top-p rows (else nothing was gained)."""
    rows = []
    real = sampler._top_k_top_p
    monkeypatch.setattr(sampler, "_top_k_top_p", lambda p, k, tp: rows.append(len(p)) or real(p, k, tp))
    logits, sb = batch("peaked", QWEN_VOCAB, cases=[SamplingParams(top_p=0.95)] * 8)
    sampler._draw(logprobs_of(logits, sb), sb)
    assert rows == []
    logits, sb = batch("flat", QWEN_VOCAB, cases=[SamplingParams(top_p=0.95)] * 2)
    sampler._draw(logprobs_of(logits, sb), sb)
    assert rows == [2]  # flat rows keep more than the candidates: the sort decides them


def test_torch_path_row_is_batch_independent_at_qwen_vocab():
    gen = torch.Generator().manual_seed(5)
    row = make_logits("bf16", 1, QWEN_VOCAB, 9)[0]
    mine = SamplingParams(top_k=40, top_p=0.9, min_p=0.01)
    for u in (0.01, 0.37, 0.999):
        alone = sample(row[None], SamplingBatch.build([mine], [u], QWEN_VOCAB, torch.device("cpu"))).tokens
        for at in (0, 29, 63):
            logits = torch.randn(64, QWEN_VOCAB, generator=gen) * torch.rand(64, 1, generator=gen) * 6
            logits[at] = row
            params = [CASES[i % len(CASES)] for i in range(64)]
            params[at] = mine
            us = torch.rand(64, dtype=torch.float64, generator=gen).tolist()
            us[at] = u
            res = sample(logits, SamplingBatch.build(params, us, QWEN_VOCAB, torch.device("cpu")))
            assert res.tokens[at] == alone[0], (u, at)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_p=0.8), SamplingParams(top_k=5, top_p=0.9), SamplingParams(min_p=0.2, top_k=6)],
    ids=lambda p: f"k{p.top_k}-p{p.top_p}-m{p.min_p}",
)
def test_torch_path_samples_the_truncated_distribution(monkeypatch, params):
    """With 4 candidates on 8 tokens, rows take both the candidates and the fallback."""
    from test_sampling import ROWS, draw, expected

    monkeypatch.setattr(sampler, "CANDIDATES", 4)
    counts, probs = draw(params), expected(params)
    assert counts[probs == 0].sum() == 0, "a truncated token was sampled"
    live = probs > 0
    assert chisquare(counts[live], probs[live] * ROWS).pvalue > 1e-3, (counts, probs * ROWS)


# -- the Triton kernel (the interpreter here; compiled on a GPU) -----------------------------------------
triton = pytest.importorskip("triton")


def kernel_draw(logits: torch.Tensor, sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    from rollout.runner.sample_kernel import sample_rows

    lp = logprobs_of(logits, sb)
    probs = sampler._padded_exp(lp)
    V = logits.shape[1]
    tokens, cuts = sample_rows(probs, V, sb.top_k, sb.top_p, sb.min_p, sb.uniforms)
    return tokens, sampler._kept_weights(probs, V, cuts, sb)


def assert_kernel_same_as_reference(logits: torch.Tensor, sb: SamplingBatch) -> None:
    want_tokens, want_weights = sampler.sort_draw(logprobs_of(logits, sb), sb)
    tokens, weights = kernel_draw(logits, sb)
    want = want_weights()
    assert torch.equal(weights > 0, want > 0), "truncation sets differ"
    assert torch.equal(weights, want)
    assert torch.equal(tokens, want_tokens)


@pytest.mark.parametrize("kind", ["flat", "peaked", "bf16", "tied"])
def test_kernel_equals_the_sort(kind):
    cases = [p for p in CASES if p.top_k <= 1000]  # the interpreter is slow: a small vocabulary
    assert_kernel_same_as_reference(*batch(kind, 2100, seed=3, cases=cases, device=DEVICE))


def test_kernel_ties_rank_by_the_lower_token_id():
    """top_k=2 inside a four-way tie for the top keeps its two lowest ids."""
    logits, sb = batch("tied", 2100, cases=[SamplingParams(top_k=2)] * 6, device=DEVICE)
    tokens, weights = kernel_draw(logits, sb)
    assert set(torch.nonzero(weights[0]).squeeze(1).tolist()) == {3, 700}
    assert set(tokens.tolist()) <= {3, 700}


def test_kernel_row_is_batch_independent():
    row = make_logits("bf16", 1, 3000, 4)[0]
    mine = SamplingParams(top_k=30, top_p=0.9, min_p=0.02)
    gen = torch.Generator().manual_seed(6)
    dev = torch.device(DEVICE)
    alone = kernel_draw(row[None].to(dev), SamplingBatch.build([mine], [0.42], 3000, dev))[0]
    for at in (0, 3, 5):
        logits = torch.randn(6, 3000, generator=gen) * 4
        logits[at] = row
        params = [CASES[i] for i in range(6)]
        params[at] = mine
        us = torch.rand(6, dtype=torch.float64, generator=gen).tolist()
        us[at] = 0.42
        tokens = kernel_draw(logits.to(dev), SamplingBatch.build(params, us, 3000, dev))[0]
        assert tokens[at] == alone[0], at


@pytest.fixture(autouse=True, scope="module")
def _quick_interpreter():
    """On the CPU the kernels run in Triton's interpreter: without its redundant re-patching of the
    language on every device-function call (tests/triton_interp.py), the same code, twice as fast."""
    with skip_repatching():
        yield


def test_kernel_samples_the_truncated_distribution():
    """3000 draws from one row's truncated distribution (top-k 6, top-p 0.9, min-p 0.05 over 8 tokens):
    no truncated token drawn, and a chi-square test of the counts against the reference truncation.

    In the interpreter each row is one program whose bisections (about 26 halvings per cut, each a pass
    over the row) call small device functions some 1,400 times; the interpreter re-patched
    `triton.language` on each call, half of a row's time (about 185 ms a row, 728 s for the test in
    CI). The module's `_quick_interpreter` fixture skips that no-op re-patching: the same kernel code,
    the same 3000 draws, and the same test, at less than half the time. The vocabulary (8 tokens, one
    block) is already as small as the test gets; fewer rows would weaken the test."""
    from test_sampling import LOGITS, expected

    rows, params = 3000, SamplingParams(top_k=6, top_p=0.9, min_p=0.05, temperature=1.2)
    us = torch.rand(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    sb = SamplingBatch.build([params] * rows, us.tolist(), len(LOGITS), torch.device(DEVICE))
    tokens, _ = kernel_draw(LOGITS.repeat(rows, 1).to(DEVICE), sb)
    counts, probs = np.bincount(tokens.cpu().numpy(), minlength=len(LOGITS)), expected(params)
    assert counts[probs == 0].sum() == 0, "a truncated token was sampled"
    live = probs > 0
    assert chisquare(counts[live], probs[live] * rows).pvalue > 1e-3, (counts, probs * rows)


@pytest.mark.parametrize("kind", ["flat", "peaked", "tied"])
def test_kernel_with_small_blocks_equals_the_sort(monkeypatch, kind):
    """Blocks of 128 tokens: 17 to a row, so the draw's block search and the one-block cumsum (not one
    block holding the whole row) decide; the result does not depend on the block size."""
    from rollout.runner import sample_kernel

    cases = [p for p in CASES if p.top_k <= 1000]
    logits, sb = batch(kind, 2100, seed=11, cases=cases, device=DEVICE)
    want = kernel_draw(logits, sb)
    monkeypatch.setattr(sample_kernel, "BLOCK", 128)
    assert sample_kernel.launch_config(2100)["BLOCK"] == 128
    assert_kernel_same_as_reference(logits, sb)
    got = kernel_draw(logits, sb)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_kernel_draw_at_block_edges(monkeypatch):
    """Weights in units of 2**-9 of 512 tokens, blocks of 128, u = (units) / 512: the target falls on a
    unit's start, at the first and last tokens of blocks; where a block's first token has no weight the
    draw moves on to the next one with weight."""
    from rollout.runner import sample_kernel

    monkeypatch.setattr(sample_kernel, "BLOCK", 128)
    uniform = torch.full((1024,), 2.0**-9)
    uniform[512:] = 0
    holes = uniform.clone()  # 128 and 256 weigh nothing; 0 and 1 two units each: 512 units in all
    holes[[128, 256]] = 0
    holes[[0, 1]] = 2.0**-8
    ids = [0, 1, 127, 128, 129, 255, 256, 383, 384, 510, 511]
    rows = [(uniform, max(i, 1e-3), i) for i in ids]  # token i starts at unit i
    rows += [(holes, 129, 127), (holes, 130, 129), (holes, 257, 257), (holes, 258, 258), (holes, 511, 511)]
    dev = torch.device(DEVICE)
    probs = torch.stack([r[0] for r in rows]).to(dev)
    sb = SamplingBatch.build([SamplingParams()] * len(rows), [r[1] / 512 for r in rows], 512, dev)
    tokens, _ = sample_kernel.sample_rows(probs, 512, sb.top_k, sb.top_p, sb.min_p, sb.uniforms)
    assert tokens.tolist() == [r[2] for r in rows]
    assert torch.equal(tokens, sampler._inverse_cdf(sampler._fixed(probs), sb.uniforms))


@pytest.mark.slow
def test_kernel_equals_the_sort_at_qwen_vocab():
    cases = [SamplingParams(top_k=40, top_p=0.9)]
    assert_kernel_same_as_reference(*batch("bf16", QWEN_VOCAB, cases=cases, device=DEVICE))


# -- on a GPU -------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["flat", "peaked", "bf16", "tied"])
def test_kernel_equals_the_sort_at_qwen_vocab_gpu(kind):
    cases = CASES * 7  # 70 rows
    assert_same_as_reference(*batch(kind, QWEN_VOCAB, cases=cases, device="cuda"))


@pytest.mark.gpu
def test_sample_replays_in_a_cuda_graph():
    """The whole sampler, the kernel included, captured once and replayed on new logits and uniforms."""
    cases = CASES * 3
    logits, sb = batch("peaked", QWEN_VOCAB, cases=cases, device="cuda")
    static = logits.clone()
    sample(static, sb)  # compile the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample(static, sb)
    for seed in (1, 2):
        new_logits, new_sb = batch("bf16", QWEN_VOCAB, seed=seed, cases=cases, device="cuda")
        static.copy_(new_logits)
        sb.uniforms.copy_(new_sb.uniforms)
        graph.replay()
        want = sample(new_logits, sb)
        assert torch.equal(out.tokens, want.tokens)
        torch.testing.assert_close(out.logprobs, want.logprobs)
