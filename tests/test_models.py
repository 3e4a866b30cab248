"""Every supported architecture against transformers: logits, greedy tokens, logprobs (float32)."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, hf_greedy, hf_logprobs

from rollout import Engine, SamplingParams
from rollout.models.toy import build_checkpoint
from rollout.runner.model_runner import ModelRunner
from rollout.state.scheduled import ScheduledBatch
from rollout.state.sequence import Sequence

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def engines(checkpoints):
    return {f: Engine(checkpoints[f], page_size=4, max_total_tokens=2048, dtype="float32") for f in FAMILIES}


def prefill_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position, from one prefill step of the engine."""
    seq = Sequence(0, 0, 0, list(prompt), len(prompt), SamplingParams(), 0)
    seq.pages = engine.pages.allocate(-(-len(prompt) // engine.kv.page_size))
    runner: ModelRunner = engine.runner
    inputs = runner.prepare(ScheduledBatch([seq], [len(prompt)], decode=False))
    inputs.logit_rows = torch.arange(len(prompt))
    try:
        return runner.forward_logits(inputs)
    finally:
        engine.pages.release(seq.pages)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(family, engines, hf_models):
    prompt = PROMPTS[3]
    ours = prefill_logits(engines[family], prompt)
    with torch.no_grad():
        ref = hf_models[family](torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours.cpu(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_and_logprobs_match_transformers(family, engines, hf_models):
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True, logprobs=True)
    outs = engines[family].generate(input_ids=PROMPTS, sampling_params=params)
    for prompt, out in zip(PROMPTS, outs):
        c = out.outputs[0]
        assert c.token_ids == hf_greedy(hf_models[family], prompt, 16)
        assert c.finish_reason == "length"
        ref = hf_logprobs(hf_models[family], prompt, c.token_ids)
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < 1e-4


def test_logprobs_at_temperature(engines, hf_models):
    params = SamplingParams(temperature=0.7, max_new_tokens=12, ignore_eos=True, logprobs=True, seed=3)
    out = engines["qwen2"].generate(input_ids=PROMPTS[0], sampling_params=params)[0].outputs[0]
    ref = hf_logprobs(hf_models["qwen2"], PROMPTS[0], out.token_ids, temperature=0.7)
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref)) < 1e-4


def test_sharded_checkpoint_and_bfloat16(tmp_path, hf_models):
    folder = build_checkpoint(
        tmp_path / "sharded", "qwen3", seed=4, tie_word_embeddings=True, max_shard_size="100KB"
    )
    assert (folder / "model.safetensors.index.json").exists()
    engine = Engine(str(folder), max_total_tokens=512, dtype="float32")
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=params)[0].outputs[0].token_ids == hf_greedy(
        hf_models["qwen3"], PROMPTS[0], 8
    )
    half = Engine(str(folder), max_total_tokens=512, dtype="bfloat16")
    assert half.model.lm_head.weight.dtype == torch.bfloat16
    assert len(half.generate(input_ids=PROMPTS[0], sampling_params=params)[0].outputs[0].token_ids) == 8


def test_text_prompts_round_trip(qwen3_dir):
    engine = Engine(qwen3_dir, max_total_tokens=512)
    out = engine.generate(
        ["12+7=", "abc"], SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert out[0].prompt == "12+7=" and out[0].prompt_token_ids == engine.tokenizer.encode("12+7=")
    assert out[1].outputs[0].text == engine.tokenizer.decode(out[1].outputs[0].token_ids)
