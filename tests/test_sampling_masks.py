"""The opt-in sampling options the vLLM front needs: allowed_token_ids, bad_words_ids and the sampled
token's rank (logprob_ranks), each checked against plain torch, in the sampler alone and end to end
against transformers' logits."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, assert_ranks
from test_sampling_options import LOGITS, PROMPT, sampler_rows
from weights_helpers import load_hf

from rollout import Engine, SamplingParams
from rollout.runner.logit_adjust import LogitAdjust
from rollout.runner.sampler import SamplingBatch, sample
from rollout.state.sequence import Sequence, uniforms


def test_allowed_token_ids_limit_the_draw_and_the_processed_logprobs():
    p = SamplingParams(temperature=1.0, allowed_token_ids=[1, 4, 6], logprobs=True, logprobs_mode="processed")
    res = sampler_rows(p, 4000)
    assert set(res.tokens.tolist()) == {1, 4, 6}
    ref = torch.full_like(LOGITS, float("-inf"))
    ref[[1, 4, 6]] = torch.log_softmax(LOGITS[[1, 4, 6]], dim=-1)
    assert torch.allclose(res.logprobs, ref[res.tokens], atol=1e-5)
    greedy = sampler_rows(SamplingParams(temperature=0, allowed_token_ids=[3, 5]), 2)
    assert greedy.tokens.tolist() == [3, 3]  # the most likely allowed one


def test_bad_words_mask_the_last_token_after_the_rest():
    # output so far (test_sampling_options.OUT) ends with [3, 6]: word [3, 6, 0] bans 0 now, [6, 1] bans
    # 1, [4, 0] does not apply; a single-token word is banned always
    p = SamplingParams(temperature=0, bad_words_ids=[[3, 6, 0], [6, 1], [4, 0], [2]])
    seqs = [Sequence(0, 0, 0, PROMPT + [1, 1, 3, 6], len(PROMPT), p, 0)]
    adjust = LogitAdjust.build(seqs, set(), len(LOGITS), torch.device("cpu"))
    x = adjust.apply(LOGITS.unsqueeze(0))[0]
    assert torch.isinf(x[[0, 1, 2]]).all() and torch.isfinite(x[3:]).all() and x[3] == LOGITS[3]
    assert sampler_rows(p, 1).tokens.tolist() == [3]  # 0, 1 and 2 are masked: the next best
    none_yet = [Sequence(0, 0, 0, PROMPT, len(PROMPT), p, 0)]  # no output: only [2] applies
    x = LogitAdjust.build(none_yet, set(), len(LOGITS), torch.device("cpu")).apply(LOGITS.unsqueeze(0))[0]
    assert torch.isinf(x[2]) and torch.isfinite(x[[0, 1, 3]]).all()


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_ranks_count_the_tokens_at_least_as_likely(mode):
    """vLLM's rank: how many tokens have a logprob >= the sampled one's, in the reported distribution."""
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    logits[:, 7] = logits[:, 3]  # ties count the tied token too
    params = [SamplingParams(temperature=1.3, logprobs=True, logprob_ranks=True, logprobs_mode=mode)] * 64
    seqs = [Sequence(i, 0, 0, [1], 1, params[i], i) for i in range(64)]
    sb = SamplingBatch.build(params, uniforms(seqs), 50, torch.device("cpu"))
    res = sample(logits, sb)
    reported = torch.log_softmax(logits / 1.3, dim=-1)  # no truncation: raw and processed agree
    chosen = reported.gather(1, res.tokens.unsqueeze(1))
    assert res.ranks.tolist() == (reported >= chosen).sum(1).tolist()
    assert res.ranks.max() > 1  # sampling picked tokens other than the most likely
    off = SamplingBatch.build([SamplingParams(logprobs=True)] * 64, uniforms(seqs), 50, torch.device("cpu"))
    assert sample(logits, off).ranks is None  # nothing computed when off


def test_ranks_and_masks_end_to_end_against_transformers(qwen3_dir):
    prompt = PROMPTS[1]
    with Engine(qwen3_dir, device="cpu", page_size=4, max_total_tokens=512) as engine:
        p = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=3, logprobs=True,
                           logprob_ranks=True)  # fmt: skip
        out = engine.generate(input_ids=[prompt], sampling_params=p)[0].outputs[0]
        allowed = engine.generate(
            input_ids=[prompt],
            sampling_params=SamplingParams(
                temperature=1.0, max_new_tokens=8, seed=4, allowed_token_ids=[5, 9, 11]
            ),
        )[0].outputs[0]
        greedy = engine.generate(
            input_ids=[prompt],
            sampling_params=SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True),
        )[0].outputs[0]
        banned = greedy.token_ids[1]
        bad = engine.generate(
            input_ids=[prompt],
            sampling_params=SamplingParams(
                temperature=0,
                max_new_tokens=4,
                ignore_eos=True,
                bad_words_ids=[[greedy.token_ids[0], banned]],
            ),
        )[0].outputs[0]
    hf = load_hf(qwen3_dir)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].float()
    assert_ranks(torch.log_softmax(logits, dim=-1), out.token_ids, out.logprob_ranks)
    assert set(allowed.token_ids) <= {5, 9, 11}
    assert bad.token_ids[0] == greedy.token_ids[0] and bad.token_ids[1] != banned
    with torch.no_grad():
        second = hf(torch.tensor([prompt + greedy.token_ids[:1]])).logits[0, -1].float()
    second[banned] = float("-inf")
    assert bad.token_ids[1] == int(second.argmax())  # the next best after the masked one


def test_mask_options_are_validated():
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words_ids entries"):
        SamplingParams(bad_words_ids=[[]])
    with pytest.raises(ValueError, match="logprob_ranks needs logprobs"):
        SamplingParams(logprob_ranks=True)
    with pytest.raises(TypeError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=["a"])
