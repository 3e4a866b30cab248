"""Qwen3.5 at the published widths (scripts/check_fidelity.py: HYBRID) against transformers, float32 on the
CPU, prompts of 1040 tokens and 64 generated tokens: logprobs within 1e-4 in prefill and decode.

0.8B (4 layers: 3 Gated DeltaNet + 1 gated attention, the real 248,320-token vocabulary) carries every
case: prefill chunks of 300 tokens (ends off the kernel's 64-token chunk), n=8 samples sharing the
prompt's prefill, preemption and recompute in a pool too small for two requests, and a partial rollout
resumed after a retract pause. 2B (4 layers) and 9B check prefill + decode only; 9B keeps one layer of
each kind, with a tied head: its embedding alone is 4 GB in float32, and the untied head would double it.
Each side is run alone (engine, freed, then transformers) so one model is in memory at a time.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout import AsyncEngine, Engine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import check_fidelity as cf  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT_LEN, NEW, TOL = 1040, 64, 1e-4
ROWS = sorted({*range(0, PROMPT_LEN, 97), PROMPT_LEN - 1})  # prefill positions compared


def engine(folder, **kw) -> Engine:
    opts = dict(device="cpu", dtype="float32", attention_backend="torch", seed=0, max_total_tokens=8192)
    return Engine(str(folder), **{**opts, **kw})


def greedy(n=NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, logprobs=True, **kw)


def free(*objs) -> None:
    del objs
    gc.collect()


def gen_logits(hf, prompt, out) -> torch.Tensor:
    """transformers' logits at the positions that predict each generated token (the head on those rows
    only: a 248k vocabulary)."""
    return cf.hf_logits(
        hf, prompt + out.token_ids, range(len(prompt) - 1, len(prompt) - 1 + len(out.token_ids))
    )


def gap(logits: torch.Tensor, out) -> float:
    """Max |engine logprob - transformers logprob| over the generated tokens."""
    return float(np.abs(np.array(out.logprobs) - cf.token_logprobs(logits, out.token_ids)).max())


def same_run(a, b) -> bool:
    """Two greedy runs of one prompt (chunked differently: float32 sums in another order): the same
    tokens, the same logprobs to the tolerance."""
    return a.token_ids == b.token_ids and np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max() <= TOL


@pytest.fixture(scope="session")
def small(tmp_path_factory):
    """The 0.8B shape: every case's engine outputs, then transformers' view of the same tokens."""
    folder = cf.build_random("qwen3.5-0.8b", tmp_path_factory.mktemp("q35") / "ckpt", layers=4)
    prompts = cf.default_prompts(248320, [PROMPT_LEN, PROMPT_LEN], seed=1)
    try:
        out = {}
        eng = engine(folder, max_prefill_tokens=300, max_running_requests=8, page_size=16)
        out["prefill"] = cf.engine_prompt_logits(eng, prompts[0], ROWS)
        out["greedy"] = eng.generate(input_ids=[prompts[0]], sampling_params=greedy(), use_tqdm=False)[0]
        before = eng.stats.prefill_tokens
        n8 = SamplingParams(temperature=1.0, max_new_tokens=NEW, ignore_eos=True, logprobs=True, n=8, seed=5)
        out["n8"] = eng.generate(input_ids=[prompts[1]], sampling_params=n8, use_tqdm=False)[0]
        out["n8_prefill"] = eng.stats.prefill_tokens - before
        out["paused"] = _paused_rollout(eng, prompts[1])
        free(eng)
        # two requests of 69 pages each in 135 pages: both start, then one is preempted and recomputed
        eng = engine(folder, max_total_tokens=135 * 16, page_size=16, max_running_requests=2)
        out["preempted"] = eng.generate(input_ids=prompts, sampling_params=greedy(), use_tqdm=False)
        out["preemptions"] = eng.scheduler.num_preemptions
        free(eng)
        hf = cf.load_hf(folder, torch.float32, "cpu")
        # one transformers forward per distinct sequence: greedy runs of the same prompt must agree
        # among themselves (preempted, paused), and n=8 is checked on its first three samples (the
        # first prefilled the prompt, the others copied its state)
        greedy0, greedy1 = out["greedy"].outputs[0], out["preempted"][1].outputs[0]
        rows = ROWS + list(range(PROMPT_LEN - 1, PROMPT_LEN - 1 + NEW))
        logits = cf.hf_logits(hf, prompts[0] + greedy0.token_ids, rows)
        out["ref_prefill"] = logits[: len(ROWS)]
        gaps = {"greedy": gap(logits[len(ROWS) :], greedy0)}
        gaps["preempted"] = gap(gen_logits(hf, prompts[1], greedy1), greedy1)
        gaps["n8"] = max(gap(gen_logits(hf, prompts[1], o), o) for o in out["n8"].outputs[:3])
        out["gaps"] = gaps
        free(hf)
        yield out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _paused_rollout(eng, prompt):
    """A greedy rollout retracted (pages and state dropped) after 16 tokens, then continued."""

    async def run():
        ae = AsyncEngine.from_engine(eng)
        try:
            stream = ae.stream(input_ids=prompt, sampling_params=greedy())
            got = []
            async for o in stream:
                got.append(o)
                if sum(len(x.outputs[0].token_ids) for x in got) >= 16:
                    break
            await ae.pause_generation("retract")
            await ae.continue_generation()
            return got + [o async for o in stream]
        finally:
            ae.close()

    got = asyncio.run(run())
    tokens = sum((o.outputs[0].token_ids for o in got), [])
    assert len(tokens) == NEW
    return SimpleNamespace(token_ids=tokens, logprobs=sum((o.outputs[0].logprobs for o in got), []))


def test_0_8b_prefill_and_decode(small):
    assert (small["prefill"] - small["ref_prefill"]).abs().max().item() <= TOL
    assert small["gaps"]["greedy"] <= TOL


def test_0_8b_n8_share_the_prefill(small):
    # the first sample computes the prompt; the others only past 1024 (the last page boundary before
    # the last token at page_size 16)
    assert small["n8_prefill"] == PROMPT_LEN + 7 * (PROMPT_LEN - 1024)
    assert len({tuple(o.token_ids) for o in small["n8"].outputs}) == 8
    assert small["gaps"]["n8"] <= TOL


def test_0_8b_preemption_and_pause(small):
    assert small["preemptions"] > 0
    assert small["gaps"]["preempted"] <= TOL
    assert same_run(small["preempted"][0].outputs[0], small["greedy"].outputs[0])
    assert same_run(small["paused"], small["preempted"][1].outputs[0])


@pytest.mark.parametrize("name,layers", [("qwen3.5-2b", 4), ("qwen3.5-9b", 2)])
def test_wider_shapes_prefill_and_decode(name, layers, tmp_path):
    overrides = {}
    if name == "qwen3.5-9b":
        overrides = dict(layer_types=["linear_attention", "full_attention"], tie_word_embeddings=True)
    folder = cf.build_random(name, tmp_path / "ckpt", layers=layers, **overrides)
    prompt = cf.default_prompts(248320, [PROMPT_LEN], seed=2)[0]
    try:
        eng = engine(folder, max_running_requests=1)
        prefill = cf.engine_prompt_logits(eng, prompt, ROWS)
        out = eng.generate(input_ids=[prompt], sampling_params=greedy(), use_tqdm=False)[0].outputs[0]
        free(eng)
        hf = cf.load_hf(folder, torch.float32, "cpu")
        assert (prefill - cf.hf_logits(hf, prompt, ROWS)).abs().max().item() <= TOL
        assert gap(gen_logits(hf, prompt, out), out) <= TOL
        free(hf)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
