"""Sampling: the empirical distribution matches the truncated softmax; seeds; logprob conventions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rollout import Engine, SamplingParams
from rollout.runner.sampler import SamplingBatch, sample
from rollout.state.sequence import Sequence, uniforms

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
ROWS = 20000


def expected(params: SamplingParams) -> np.ndarray:
    """Reference truncation: top-k, then top-p over the renormalised rest, then min-p."""
    p = torch.softmax(LOGITS.double() / params.temperature, dim=0).numpy()
    order = np.argsort(-p)
    keep = np.zeros_like(p, dtype=bool)
    k = params.top_k if params.top_k > 0 else len(p)
    kept = order[:k]
    mass = p[kept] / p[kept].sum()
    cum_before = np.cumsum(mass) - mass
    kept = kept[cum_before < params.top_p]
    keep[kept] = True
    keep &= p >= params.min_p * p[kept].max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def draw(params: SamplingParams, seed: int = 0) -> np.ndarray:
    seqs = [Sequence(i, 0, 0, [0], 1, params, seed * ROWS + i) for i in range(ROWS)]
    sb = SamplingBatch.build([params] * ROWS, uniforms(seqs), len(LOGITS), torch.device("cpu"))
    res = sample(LOGITS.repeat(ROWS, 1), sb)
    return np.bincount(res.tokens.numpy(), minlength=len(LOGITS))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=1.5, top_k=6, top_p=0.95, min_p=0.05),
    ],
    ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}",
)
def test_empirical_distribution_matches(params):
    counts, probs = draw(params), expected(params)
    assert counts[probs == 0].sum() == 0, "a truncated token was sampled"
    live = probs > 0
    stat = chisquare(counts[live], probs[live] * ROWS)
    assert stat.pvalue > 1e-3, (counts, probs * ROWS)


def test_logprobs_are_taken_before_truncation():
    params = SamplingParams(temperature=0.7, top_k=2, logprobs=True, top_logprobs=3)
    sb = SamplingBatch.build([params] * 4, [0.1, 0.4, 0.6, 0.9], len(LOGITS), torch.device("cpu"))
    res = sample(LOGITS.repeat(4, 1), sb)
    full = torch.log_softmax(LOGITS / 0.7, dim=0)
    torch.testing.assert_close(res.logprobs, full[res.tokens])
    torch.testing.assert_close(res.top_logprobs[0], full.topk(3).values)


def test_greedy_rows_beside_sampled_rows():
    ps = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=4)]
    sb = SamplingBatch.build(ps, [0.99, 0.99], len(LOGITS), torch.device("cpu"))
    res = sample(LOGITS.repeat(2, 1), sb)
    assert res.tokens[0] == 0 and res.tokens[1] == 3  # u = 0.99 lands on the last kept token
    torch.testing.assert_close(res.logprobs[0], torch.log_softmax(LOGITS, 0)[0])


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return Engine(qwen3_dir, page_size=4, max_total_tokens=4096, dtype="float32")


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    prompt = [5, 6, 7, 8, 9]
    p = SamplingParams(
        n=3, temperature=1.0, top_p=0.9, max_new_tokens=24, ignore_eos=True, seed=7, logprobs=True
    )
    alone = engine.generate(input_ids=[prompt], sampling_params=p)[0]
    again = engine.generate(input_ids=[prompt], sampling_params=p)[0]
    others = SamplingParams(n=2, temperature=1.3, max_new_tokens=30, ignore_eos=True)
    crowded = engine.generate(
        input_ids=[[3, 4], prompt, list(range(40, 60))], sampling_params=[others, p, others]
    )[1]
    ids = [c.token_ids for c in alone.outputs]
    assert ids == [c.token_ids for c in again.outputs] == [c.token_ids for c in crowded.outputs]
    assert len({tuple(t) for t in ids}) > 1, "the n samples of a seeded request must differ"
    other_seed = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=24, ignore_eos=True, seed=8)
    assert [
        c.token_ids for c in engine.generate(input_ids=[prompt], sampling_params=other_seed)[0].outputs
    ] != ids


def test_engine_samples_the_model_distribution(engine, hf_models):
    """One token from one prompt, many times: counts follow the transformers softmax at temperature 0.8."""
    prompt = [7, 8, 9, 10]
    p = SamplingParams(n=3000, temperature=0.8, max_new_tokens=1, ignore_eos=True)
    outs = engine.generate(input_ids=[prompt], sampling_params=p)[0].outputs
    with torch.no_grad():
        logits = hf_models["qwen3"](torch.tensor([prompt])).logits[0, -1].double()
    probs = torch.softmax(logits / 0.8, dim=0).numpy()
    counts = np.bincount([c.token_ids[0] for c in outs], minlength=len(probs))
    common = probs * 3000 >= 5  # pool rare tokens so the chi-square test is valid
    f_obs = np.append(counts[common], counts[~common].sum())
    f_exp = np.append(probs[common], probs[~common].sum()) * 3000
    assert chisquare(f_obs, f_exp).pvalue > 1e-3


@pytest.mark.parametrize("vocab", [7, 1024, 1025, 5000])
def test_two_level_inverse_cdf_equals_a_full_cumsum(vocab):
    from rollout.runner.sampler import FIXED_ONE, _fixed, _inverse_cdf

    gen = torch.Generator().manual_seed(vocab)
    probs = torch.rand(64, vocab, generator=gen) * (torch.rand(64, vocab, generator=gen) > 0.5)
    probs[:, 0] += 0.01  # every row has mass
    weights = _fixed(probs / probs.sum(-1, keepdim=True))
    assert (weights.sum(-1) < 2 * FIXED_ONE).all()
    u = torch.rand(64, dtype=torch.float64, generator=gen)
    cdf = weights.cumsum(-1)
    target = (u * cdf[:, -1].double()).long().unsqueeze(1)
    direct = torch.searchsorted(cdf, target, right=True).squeeze(1)
    assert torch.equal(_inverse_cdf(weights, u), direct)
