"""Continuous batching, prefix sharing, the prefix cache, chunked prefill and preemption change no result."""

from __future__ import annotations

import pytest
from helpers import PROMPTS, hf_greedy

from rollout import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, logprobs=True)


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def alone(qwen3_dir):
    engine = Engine(qwen3_dir, page_size=4, max_total_tokens=4096, dtype="float32")
    return [engine.generate(input_ids=p, sampling_params=GREEDY)[0] for p in PROMPTS]


def test_mixed_batch_equals_each_alone(qwen3_dir, alone, hf_models):
    engine = Engine(qwen3_dir, page_size=4, max_total_tokens=4096, dtype="float32")
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert tokens(outs) == tokens(alone)
    assert outs[0].outputs[0].token_ids == hf_greedy(hf_models["qwen3"], PROMPTS[0], 20)
    for o, a in zip(outs, alone):
        assert o.outputs[0].logprobs == pytest.approx(a.outputs[0].logprobs, abs=1e-5)


def test_chunked_prefill_and_small_running_cap(qwen3_dir, alone):
    engine = Engine(
        qwen3_dir, page_size=4, max_total_tokens=4096, max_prefill_tokens=5, max_running_requests=2
    )
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert tokens(outs) == tokens(alone)


def test_n_samples_share_the_prompt(qwen3_dir, alone):
    engine = Engine(qwen3_dir, page_size=4, max_total_tokens=4096, dtype="float32")
    n4 = SamplingParams(n=4, temperature=0, max_new_tokens=20, ignore_eos=True)
    outs = engine.generate(input_ids=[PROMPTS[3]], sampling_params=n4)
    assert [c.token_ids for c in outs[0].outputs] == [alone[3].outputs[0].token_ids] * 4
    # the prompt (37 tokens, 9 full pages of 4) is prefilled once; each follower recomputes < 2 pages
    assert engine.last_stats["prefill_tokens"] < 37 + 3 * 8


def test_prefix_cache_across_calls_until_flush(qwen3_dir, alone):
    engine = Engine(qwen3_dir, page_size=4, max_total_tokens=4096, dtype="float32")
    first = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    cold = engine.last_stats["prefill_tokens"]
    second = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    warm = engine.last_stats["prefill_tokens"]
    assert tokens(first) == tokens(second) == tokens(alone)
    assert warm < cold / 2
    engine.flush_cache()
    engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert engine.last_stats["prefill_tokens"] == cold


def test_preemption_recomputes_and_completes(qwen3_dir, alone):
    # 12 pages of 4 tokens cannot hold all five sequences at once (up to 57 tokens each)
    engine = Engine(qwen3_dir, page_size=4, max_total_tokens=64, enable_prefix_cache=False)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert engine.last_stats["preemptions"] > 0
    assert tokens(outs) == tokens(alone)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert engine.pages.available() == engine.kv.num_pages  # every page came back


def test_sampled_preemption_keeps_seeded_tokens(qwen3_dir):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=11)
    roomy = Engine(qwen3_dir, page_size=4, max_total_tokens=4096, dtype="float32").generate(
        input_ids=PROMPTS, sampling_params=params
    )
    tight_engine = Engine(qwen3_dir, page_size=4, max_total_tokens=64)
    tight = tight_engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert tight_engine.last_stats["preemptions"] > 0
    assert tokens(roomy) == tokens(tight)
