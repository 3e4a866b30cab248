"""Engine.score and SamplingParams.prompt_logprobs: logprobs of given tokens through the paged KV cache,
equal to transformers' log_softmax, to what generate returned, shared across a GRPO group, chunked."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS

from rollout import Engine, SamplingParams

SEQS = [PROMPTS[0] + [40, 41, 42, 43, 44, 45], PROMPTS[1], PROMPTS[3], [3, 9]]


def hf_all_logprobs(model, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len - 1, vocab]: log_softmax at every position, as a trainer recomputes it."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def engine_for(path: str, **kw) -> Engine:
    return Engine(path, device="cpu", page_size=4, max_total_tokens=4096, **kw)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_score_equals_transformers(checkpoints, hf_models, family):
    engine, model = engine_for(checkpoints[family]), hf_models[family]
    starts = [3, 1, 20, 1]
    outs = engine.score(input_ids=SEQS, start=starts, top_logprobs=3, temperature=0.7)
    for seq, s, out in zip(SEQS, starts, outs):
        ref = hf_all_logprobs(model, seq, 0.7)
        want = ref[torch.arange(s - 1, len(seq) - 1), torch.tensor(seq[s:])]
        assert out.token_ids == seq and out.start == s and len(out.logprobs) == len(seq) - s
        assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)
        for j, top in enumerate(out.top_logprobs):
            v, ix = ref[s - 1 + j].topk(3)
            assert list(top) == ix.tolist()
            assert torch.allclose(torch.tensor(list(top.values())), v, atol=1e-4, rtol=0)
    plain = engine.score(input_ids=SEQS)  # start=1, temperature 1, no tops
    for seq, out in zip(SEQS, plain):
        ref = hf_all_logprobs(model, seq)
        want = ref[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
        assert out.top_logprobs is None
        assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)


def test_score_equals_generate_logprobs_and_shares_the_group_prompt(qwen3_dir):
    engine = engine_for(qwen3_dir)
    prompt = list(range(5, 22))  # 17 tokens: four full pages and one token
    p = SamplingParams(n=6, temperature=0.9, max_new_tokens=10, ignore_eos=True, logprobs=True, seed=5)
    group = engine.generate(input_ids=[prompt], sampling_params=p)[0].outputs
    engine.flush_cache()  # so only the group's own sharing counts below
    seqs = [prompt + c.token_ids for c in group]
    scored = engine.score(input_ids=seqs, start=len(prompt), temperature=0.9)
    for c, s in zip(group, scored):
        # the engine's decode steps (one row per matmul) and this prefill (all rows at once) sum in a
        # different order on the CPU: agreement is to float32 rounding of a few ulps, not bitwise
        assert max(abs(a - b) for a, b in zip(c.logprobs, s.logprobs)) <= 1e-5
    # the first sequence computes everything; each other one reuses the whole pages before the
    # position whose logits score its first completion token (16 of the 17 prompt tokens)
    reused = (len(prompt) - 1) // 4 * 4
    expected = len(seqs[0]) + sum(len(s) - reused for s in seqs[1:])
    assert engine.last_stats["prefill_tokens"] == expected < sum(map(len, seqs))


def test_chunked_and_preempted_scoring_equals_whole(qwen3_dir):
    whole = engine_for(qwen3_dir).score(input_ids=SEQS, top_logprobs=2)
    chunked = Engine(qwen3_dir, device="cpu", page_size=4, max_total_tokens=64, max_prefill_tokens=5)
    outs = chunked.score(input_ids=SEQS, top_logprobs=2)
    assert chunked.last_stats["steps"] > 10
    for a, b in zip(whole, outs):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert [list(t) for t in a.top_logprobs] == [list(t) for t in b.top_logprobs]


def test_generate_prompt_logprobs(qwen3_dir, hf_models):
    engine, model = engine_for(qwen3_dir), hf_models["qwen3"]
    p = SamplingParams(n=3, max_new_tokens=4, ignore_eos=True, seed=1, prompt_logprobs=2)
    outs = engine.generate(input_ids=PROMPTS[:4], sampling_params=[p, p, SamplingParams(max_new_tokens=2), p])
    for prompt, out in zip(PROMPTS[:4], outs):
        if out is outs[2]:
            assert out.prompt_logprobs is None and out.prompt_top_logprobs is None
            continue
        ref = hf_all_logprobs(model, prompt)
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(torch.tensor(out.prompt_logprobs), want, atol=1e-4, rtol=0)
        assert [list(t) for t in out.prompt_top_logprobs] == ref.topk(2).indices.tolist()
        assert len(out.outputs) == 3
    again = engine.generate(
        input_ids=PROMPTS[:1], sampling_params=SamplingParams(max_new_tokens=2, prompt_logprobs=0)
    )
    # the prompt's cached pages are not used: it is computed again (alone now, so to float rounding)
    assert again[0].prompt_logprobs == pytest.approx(outs[0].prompt_logprobs, abs=1e-5)
    assert again[0].prompt_top_logprobs is None


def test_bad_score_inputs_name_the_field(qwen3_dir):
    engine = engine_for(qwen3_dir)
    cases = [
        (dict(input_ids=SEQS, start=0), ValueError, "start"),
        (dict(input_ids=SEQS, start=len(SEQS[3])), ValueError, "start"),
        (dict(input_ids=SEQS, start=[1, 2]), ValueError, "start"),
        (dict(input_ids=SEQS, start="1"), TypeError, "start"),
        (dict(input_ids=SEQS, top_logprobs=-1), ValueError, "top_logprobs"),
        (dict(input_ids=SEQS, temperature=-1.0), ValueError, "temperature"),
        (dict(input_ids=[[1, 10**6]]), ValueError, "vocabulary"),
        (dict(input_ids=[[5]]), ValueError, "start"),
    ]
    for kwargs, err, field in cases:
        with pytest.raises(err, match=field):
            engine.score(**kwargs)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    assert engine.stats.requests == 0 and engine.stats.pages_free == engine.stats.pages_total
    assert len(engine.score(input_ids=SEQS[:1])[0].logprobs) == len(SEQS[0]) - 1


@pytest.mark.gpu
def test_score_bf16_on_gpu_equals_transformers(qwen3_dir):
    """The fidelity bound of docs/fidelity.md: against float32 transformers, the engine's bf16 error is
    at most 1.1x transformers' own bf16 error (two bf16 implementations differ in rounding, so they are
    not compared with each other)."""
    from transformers import AutoModelForCausalLM

    engine = Engine(qwen3_dir, device="cuda", dtype="bfloat16", page_size=16, max_total_tokens=8192)
    vocab = engine.model_config.vocab_size
    seqs = [[3 + i % (vocab - 3) for i in range(n)] for n in (40, 129, 300)]
    got = torch.cat([torch.tensor(out.logprobs) for out in engine.score(input_ids=seqs)])
    engine.shutdown()

    def hf_logprobs(dtype: torch.dtype) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=dtype).cuda().eval()
        rows = []
        for seq in seqs:
            with torch.no_grad():
                logits = model(torch.tensor([seq], device="cuda")).logits[0, :-1].float()
            rows.append(torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])])
        return torch.cat(rows).cpu()

    exact, hf_bf16 = hf_logprobs(torch.float32), hf_logprobs(torch.bfloat16)
    engine_gap, hf_gap = (got - exact).abs().mean(), (hf_bf16 - exact).abs().mean()
    assert engine_gap <= 1.1 * hf_gap + 1e-4, (engine_gap, hf_gap)


def test_score_across_an_engine_process(qwen3_dir):
    from rollout import EngineProcess

    local = engine_for(qwen3_dir).score(input_ids=SEQS, start=1, top_logprobs=1)
    with EngineProcess(qwen3_dir, device="cpu", page_size=4, max_total_tokens=4096) as proc:
        remote = proc.score(input_ids=SEQS, start=1, top_logprobs=1)
    assert remote == local  # same engine, same schedule: the same bits
