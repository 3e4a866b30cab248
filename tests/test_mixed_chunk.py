"""Mixed steps (EngineConfig.mixed_chunk, on by default): a prefill step also decodes one token of every
running sequence, so requests arriving one by one do not each cost the running ones a step. Outputs
must equal the unmixed schedule's (greedy and seeded, logprobs, stops, n > 1, preemption), with the
plain and the overlap schedule (whose decoding rows take their input ids from the step in flight)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, arrive_one_a_step

from rollout import Engine, SamplingParams
from rollout.models.config import ModelConfig

ENGINE = dict(device="cpu", max_total_tokens=4096, page_size=4)


def params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_new_tokens=9, logprobs=True),
        SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=14, seed=5, n=3, logprobs=True),
        SamplingParams(temperature=0.0, max_new_tokens=30, stop=["a", "b", "1"]),
        SamplingParams(temperature=0.8, top_k=5, max_new_tokens=20, seed=9, prompt_logprobs=0),
        SamplingParams(temperature=1.0, max_new_tokens=12, seed=2, repetition_penalty=1.3, min_tokens=4),
    ]


def arrive(engine: Engine, prompts: list[list[int]]) -> tuple[dict, dict]:
    """Request i (the params of `params()` in turn) arrives before step i; returns each request's output
    and the step that reported it."""
    done, ended, _ = arrive_one_a_step(engine, [(f"r{i}", q, params()[i % 5]) for i, q in enumerate(prompts)])
    return done, ended


def comparable(outs: dict) -> dict:
    return {
        rid: [(c.token_ids, c.finish_reason, c.stop_reason, c.weight_versions) for c in o.outputs]
        for rid, o in outs.items()
    }


@pytest.mark.parametrize("overlap", [False, True])
def test_arrivals_one_by_one_equal_the_unmixed_schedule_and_stall_nobody(qwen3_dir, overlap):
    runs, ends, counts = [], [], []
    for mixed in (False, True):
        engine = Engine(qwen3_dir, **ENGINE, overlap_schedule=overlap, mixed_chunk=mixed)
        done, ended = arrive(engine, PROMPTS * 3)
        runs.append(done), ends.append(ended)
        counts.append((engine.stats.prefill_steps, engine.stats.decode_tokens))
    assert comparable(runs[0]) == comparable(runs[1])
    for rid, plain in runs[0].items():
        for p, q in zip(plain.outputs, runs[1][rid].outputs):
            if p.logprobs is not None:
                assert q.logprobs == pytest.approx(p.logprobs, abs=1e-5)
        if plain.prompt_logprobs is not None:
            assert runs[1][rid].prompt_logprobs[1:] == pytest.approx(plain.prompt_logprobs[1:], abs=1e-5)
    assert counts[0] == counts[1]  # the same prefill steps; every output token counted once
    # unmixed, the first request decodes nothing while the other 14 arrive (a prefill step each); mixed,
    # it decodes in those steps: its 9 tokens come from its prefill and the next 8 steps
    unmixed, mixed = ends[0]["r0"], ends[1]["r0"]
    assert mixed == 8 + overlap and unmixed == mixed + 14, (unmixed, mixed)
    assert sum(ends[1].values()) < sum(ends[0].values())


def test_a_prefill_step_carries_every_decoding_sequence(qwen3_dir):
    seen = {}
    for mixed in (False, True):
        engine = Engine(qwen3_dir, **ENGINE, mixed_chunk=mixed)
        p = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        engine.add_request("a", PROMPTS[0], p)
        engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=8, n=2))
        engine.step(), engine.step()  # prefill a and b (b's second sample shares the prompt), one decode
        before = engine.stats
        engine.add_request("c", PROMPTS[3], p)
        engine.step()  # c's prefill: with mixing, a and b's samples decode in it too
        after = engine.stats
        seen[mixed] = (after.prefill_steps - before.prefill_steps, after.decode_tokens - before.decode_tokens)
        while engine.has_unfinished():
            engine.step()
    assert seen[False] == (1, 0)
    assert seen[True] == (1, 3)


def test_a_full_pool_leaves_riders_for_the_decode_step_that_preempts(qwen3_dir):
    """With pages too few for everyone, riders that cannot grow wait for the next decode step (which
    preempts); the outputs are the unmixed schedule's, with preemptions in both."""
    small = dict(device="cpu", page_size=4, max_total_tokens=96)
    p = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (9, 5, 12, 7, 3, 10)]
    runs = []
    for mixed in (False, True):
        engine = Engine(qwen3_dir, **small, mixed_chunk=mixed)
        done, _, _ = arrive_one_a_step(engine, [(f"r{i}", q, p) for i, q in enumerate(prompts)], every=3)
        assert engine.stats.preemptions > 0
        runs.append(comparable(done))
    assert runs[0] == runs[1]


def test_mixed_chunk_must_be_a_bool(qwen3_dir):
    with pytest.raises(TypeError, match="mixed_chunk"):
        Engine(qwen3_dir, **ENGINE, mixed_chunk=1)


def test_mixed_steps_at_a_real_shape_match_transformers(tmp_path):
    """Qwen2.5-0.5B's published config cut to one layer (GQA group 7, head dim 64, 151,936-token vocab),
    float32: prompts arriving one a step, chunked under a small budget, with the running requests
    decoding in those prefill steps. Each greedy token's logprob matches float32 transformers read back
    from the same folder, and each token is its argmax."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import check_fidelity as cf

    folder = cf.build_random("qwen2.5-0.5b", tmp_path / "ckpt", layers=1)
    vocab = ModelConfig.from_path(folder).vocab_size
    prompts = cf.default_prompts(vocab, [300, 37, 129, 5, 211], seed=2)
    p = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, logprobs=True)
    engine = Engine(folder, device="cpu", page_size=16, max_total_tokens=4096, max_prefill_tokens=128)
    done, _, mixed = arrive_one_a_step(engine, [(f"r{i}", q, p) for i, q in enumerate(prompts)])
    assert mixed >= 2  # decoding rows rode in prefill steps
    del engine
    hf = cf.load_hf(folder, torch.float32, "cpu")
    for i, prompt in enumerate(prompts):
        c = done[f"r{i}"].outputs[0]
        rows = list(range(len(prompt) - 1, len(prompt) - 1 + len(c.token_ids)))
        ref = torch.log_softmax(cf.hf_logits(hf, prompt + c.token_ids, rows).double(), dim=-1)
        picked = ref.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert (torch.tensor(c.logprobs, dtype=torch.float64) - picked).abs().max() <= 1e-4
        assert (ref.max(dim=-1).values - picked <= 1e-4).all()
