"""How samples end: EOS, stop tokens, stop strings, max_new_tokens; and the default job runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rollout import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return Engine(qwen3_dir, page_size=4, max_total_tokens=2048)


@pytest.fixture(scope="module")
def free_run(engine):
    """A greedy 24-token run with EOS ignored: the reference the stop tests cut."""
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, logprobs=True)
    return engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)[0].outputs[0]


def test_stop_token_ids_end_the_sample(engine, free_run):
    stop_tok = free_run.token_ids[5]
    first = free_run.token_ids.index(stop_tok)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok])
    out = engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)[0].outputs[0]
    assert out.token_ids == free_run.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_eos_unless_ignored(engine, free_run):
    stops = engine.scheduler.stops  # what the checkpoint's config would set as its EOS ids
    stops.eos_ids = frozenset({free_run.token_ids[3]})
    try:
        params = SamplingParams(temperature=0, max_new_tokens=24)
        out = engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)[0].outputs[0]
        first = free_run.token_ids.index(free_run.token_ids[3])
        assert out.token_ids == free_run.token_ids[: first + 1] and out.finish_reason == "stop"
    finally:
        stops.eos_ids = frozenset(engine.model_config.eos_token_ids)


def test_stop_string_truncates_text(engine, free_run):
    text = engine.tokenizer.decode(free_run.token_ids)
    stop = text[6:8]
    cut = text.find(stop)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop=stop)
    out = engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == free_run.token_ids[: cut + len(stop)]  # one char per token


def test_length_and_top_logprobs(engine, free_run):
    params = SamplingParams(temperature=0, max_new_tokens=7, ignore_eos=True, logprobs=True, top_logprobs=3)
    out = engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == free_run.token_ids[:7]
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 3 and max(top, key=top.get) == tok and top[tok] == pytest.approx(lp)


def test_default_job_runs(tmp_path):
    env = {**os.environ, "ROLLOUT_CACHE": str(tmp_path)}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout",
            "--generate",
            "--device",
            "cpu",
            "--n",
            "2",
            "--max-new-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "output tokens/s" in res.stdout and "logprobs:" in res.stdout
