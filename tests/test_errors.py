"""Bad input is rejected before any work starts, naming the field, and the engine stays usable."""

from __future__ import annotations

import json
import shutil

import pytest

from rollout import Engine, SamplingParams

OK = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return Engine(qwen3_dir, page_size=4, max_total_tokens=256, max_model_len=128)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(n=0), ValueError, "n must be >= 1"),
        (dict(n=1.5), TypeError, "n must be an int"),
        (dict(temperature=-0.1), ValueError, "temperature"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.2), ValueError, "top_p"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=-2), ValueError, "top_k"),
        (dict(min_p=1.0), ValueError, "min_p"),
        (dict(min_p=-0.1), ValueError, "min_p"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(stop=[""]), TypeError, "stop"),
        (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids"),
        (dict(top_logprobs=-1), ValueError, "top_logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (dict(), ValueError, "exactly one of prompts"),
        (dict(prompts=["a"], input_ids=[[1]]), ValueError, "exactly one of prompts"),
        (dict(input_ids=[[]]), ValueError, r"input_ids\[0\] is empty"),
        (dict(input_ids=[[5], []]), ValueError, r"input_ids\[1\] is empty"),
        (dict(input_ids=[[5, 10**6]]), ValueError, "outside the vocabulary"),
        (dict(input_ids=[[5, -1]]), ValueError, "outside the vocabulary"),
        (dict(input_ids=[[5, "a"]]), TypeError, "not an int token id"),
        (dict(input_ids="abc"), TypeError, "input_ids must be"),
        (dict(prompts=[""]), ValueError, r"prompts\[0\] is empty"),
        (dict(prompts=[3]), TypeError, "prompts must be"),
        (
            dict(input_ids=[[5] * 100], sampling_params=SamplingParams(max_new_tokens=40)),
            ValueError,
            "max_model_len",
        ),
        (dict(input_ids=[[5], [6]], sampling_params=[OK]), ValueError, "sampling_params has 1 entries for 2"),
        (dict(input_ids=[[5]], sampling_params={"n": 2}), TypeError, "sampling_params must be"),
    ],
)
def test_bad_generate_calls_leave_engine_usable(engine, call, error, match):
    before = engine.generate(input_ids=[[5, 6, 7]], sampling_params=OK)[0].outputs[0].token_ids
    with pytest.raises(error, match=match):
        engine.generate(**call)
    assert not engine.scheduler.has_work()
    assert engine.generate(input_ids=[[5, 6, 7]], sampling_params=OK)[0].outputs[0].token_ids == before


def test_text_prompt_without_tokenizer(qwen3_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(f"{qwen3_dir}/{f}", bare / f)
    engine = Engine(str(bare), max_total_tokens=256)
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.generate(["hello"], OK)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.generate(input_ids=[[5]], sampling_params=SamplingParams(stop=["x"]))
    assert engine.generate(input_ids=[[5]], sampling_params=OK)[0].outputs[0].text == ""


def test_prompt_larger_than_kv_pool(qwen3_dir):
    engine = Engine(qwen3_dir, page_size=4, max_total_tokens=32)
    with pytest.raises(ValueError, match="KV pool"):
        engine.generate(input_ids=[[5] * 30], sampling_params=OK)


def test_bad_checkpoints(qwen3_dir, tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        Engine(str(tmp_path / "missing"))
    odd = tmp_path / "odd"
    shutil.copytree(qwen3_dir, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        Engine(str(odd))
    (odd / "model.safetensors").unlink()
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="safetensors"):
        Engine(str(odd))


@pytest.mark.parametrize(
    "option, value, match",
    [
        ("dtype", "int8", "dtype"),
        ("page_size", 0, "page_size"),
        ("max_total_tokens", -5, "max_total_tokens"),
        ("mem_fraction", 1.5, "mem_fraction"),
        ("attention_backend", "magic", "attention_backend"),
        ("max_model_len", 10**7, "max_model_len"),
    ],
)
def test_bad_engine_options(qwen3_dir, option, value, match):
    with pytest.raises(ValueError, match=match):
        Engine(qwen3_dir, **{option: value})
