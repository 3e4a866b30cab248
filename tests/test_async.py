"""AsyncEngine: many callers over one step loop; abort, the pause modes, updates while paused, per-token
weight versions, partial-rollout resume, shutdown with requests in flight."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from helpers import PROMPTS

from rollout import AsyncEngine, Engine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=True)
LONG = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return Engine(qwen3_dir, device="cpu", max_total_tokens=8192, page_size=4)


@pytest.fixture
def aengine(engine):
    ae = AsyncEngine.from_engine(engine)
    yield ae
    ae.close()
    assert not engine.has_unfinished()


def _greedy(engine, prompt, params=GREEDY):
    return engine.generate(input_ids=[prompt], sampling_params=params)[0].outputs[0]


def _noisy_state(engine, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = engine.get_weights_by_name("lm_head.weight")
    return [("lm_head.weight", w + torch.randn(w.shape, generator=g) * 2.0)]


def test_concurrent_tasks_and_threads_equal_engine_generate(engine, aengine):
    expected = [_greedy(engine, p).token_ids for p in PROMPTS]

    async def many() -> list[list[int]]:
        outs = await asyncio.gather(*(aengine.generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS))
        return [o.outputs[0].token_ids for o in outs]

    results: dict[int, list] = {}
    threads = [
        threading.Thread(target=lambda k=k: results.update({k: asyncio.run(many())})) for k in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results[k] for k in range(3)] == [expected] * 3
    text = asyncio.run(aengine.generate("ab c", GREEDY))
    assert text.outputs[0].token_ids == _greedy(engine, engine.tokenizer.encode("ab c")).token_ids


def test_stream_deltas_add_up_and_carry_weight_versions(engine, aengine):
    whole = _greedy(engine, PROMPTS[0])

    async def run():
        return [o async for o in aengine.stream(input_ids=PROMPTS[0], sampling_params=GREEDY)]

    outs = asyncio.run(run())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert sum((o.outputs[0].token_ids for o in outs), []) == whole.token_ids
    assert sum((o.outputs[0].logprobs for o in outs), []) == pytest.approx(whole.logprobs, abs=1e-5)
    assert "".join(o.outputs[0].text for o in outs) == whole.text
    v = engine.weight_version
    assert sum((o.outputs[0].weight_versions for o in outs), []) == [v] * len(whole.token_ids)


async def _wait_tokens(ae: AsyncEngine, stream, at_least: int) -> list:
    got = []
    async for out in stream:
        got.append(out)
        if sum(len(o.outputs[0].token_ids) for o in got) >= at_least:
            return got
    return got


def test_abort_returns_partial_output_and_frees_pages(engine, aengine):
    async def run():
        task = asyncio.create_task(
            aengine.generate(input_ids=PROMPTS[1], sampling_params=LONG, request_id="x")
        )
        while engine.stats.decode_tokens == 0 or not engine.has_unfinished():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert await aengine.abort("x")
        assert not await aengine.abort("x")
        return await task

    out = asyncio.run(run()).outputs[0]
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < LONG.max_new_tokens
    assert len(out.logprobs) == len(out.token_ids) == len(out.weight_versions)
    assert engine.stats.requests == 0 and engine.stats.pages_free == engine.stats.pages_total
    full = _greedy(engine, PROMPTS[1], LONG).token_ids
    assert out.token_ids == full[: len(out.token_ids)]


def test_pause_abort_ends_requests_and_allows_an_update(engine, aengine):
    before = engine.get_weights_by_name("lm_head.weight")

    async def run():
        stream = aengine.stream(input_ids=PROMPTS[0], sampling_params=LONG)
        got = await _wait_tokens(aengine, stream, 3)
        await aengine.pause_generation("abort")
        got += [o async for o in stream]
        await aengine.update_weights_from_tensor([("lm_head.weight", before)])
        await aengine.continue_generation()
        return got

    got = asyncio.run(run())
    assert got[-1].finished and got[-1].outputs[0].finish_reason == "abort"
    tokens = sum((o.outputs[0].token_ids for o in got), [])
    assert tokens == _greedy(engine, PROMPTS[0], LONG).token_ids[: len(tokens)]


def test_retract_update_continue_resumes_with_new_weights(engine, aengine):
    old = engine.get_weights_by_name("lm_head.weight")
    reference = _greedy(engine, PROMPTS[2], LONG).token_ids

    async def run():
        stream = aengine.stream(input_ids=PROMPTS[2], sampling_params=LONG)
        got = await _wait_tokens(aengine, stream, 4)
        await aengine.pause_generation("retract")
        assert engine.stats.running == 0 and engine.stats.requests == 1
        v = await aengine.update_weights_from_tensor(_noisy_state(engine, 1))
        await aengine.continue_generation()
        got += [o async for o in stream]
        return got, v

    try:
        got, _ = asyncio.run(run())
    finally:
        engine.update_weights_from_tensor([("lm_head.weight", old)])
    tokens = sum((o.outputs[0].token_ids for o in got), [])
    versions = sum((o.outputs[0].weight_versions for o in got), [])
    assert got[-1].outputs[0].finish_reason == "length" and len(tokens) == LONG.max_new_tokens
    assert len(versions) == len(tokens) and versions[0] < versions[-1]  # both versions sampled
    switch = versions.index(versions[-1])
    assert tokens[:switch] == reference[:switch] and tokens != reference  # new weights, new tokens


def test_in_place_pause_keeps_pages_and_refuses_updates(engine, aengine):
    async def run():
        task = asyncio.create_task(aengine.generate(input_ids=PROMPTS[3], sampling_params=GREEDY))
        while engine.stats.decode_tokens == 0 or not engine.has_unfinished():
            await asyncio.sleep(0.01)
        await aengine.pause_generation("in_place")
        steps = engine.stats.steps
        await asyncio.sleep(0.1)
        assert engine.stats.steps == steps and engine.stats.running == 1  # no step, pages kept
        with pytest.raises(RuntimeError, match="in flight"):
            await aengine.flush_cache() or await aengine.update_weights_from_tensor(_noisy_state(engine, 2))
        await aengine.continue_generation()
        return await task

    out = asyncio.run(run()).outputs[0]
    assert out.token_ids == _greedy(engine, PROMPTS[3]).token_ids


def test_partial_rollout_resumes_without_recomputing_its_prefix(engine, aengine):
    full = _greedy(engine, PROMPTS[3], LONG).token_ids

    async def run():
        start = engine.stats.decode_tokens
        task = asyncio.create_task(
            aengine.generate(input_ids=PROMPTS[3], sampling_params=LONG, request_id="p")
        )
        while engine.stats.decode_tokens < start + 10:
            await asyncio.sleep(0.01)
        await aengine.abort("p")
        part = (await task).outputs[0].token_ids
        before = engine.stats.prefill_tokens
        rest = SamplingParams(
            temperature=0.0, max_new_tokens=LONG.max_new_tokens - len(part), ignore_eos=True
        )
        tail = await aengine.generate(input_ids=PROMPTS[3] + part, sampling_params=rest)
        return part, tail.outputs[0].token_ids, engine.stats.prefill_tokens - before

    part, tail, prefilled = asyncio.run(run())
    assert part + tail == full
    # only the tail is computed again: the last partial page (once, in a loaded full run, one page
    # more: 8 tokens at page_size 4; not yet explained), never the prompt
    assert prefilled <= 2 * engine.stats.page_size < len(PROMPTS[3])


def test_shutdown_with_requests_in_flight_aborts_them(qwen3_dir):
    async def run():
        ae = AsyncEngine(qwen3_dir, device="cpu", max_total_tokens=4096, page_size=4)
        tasks = [asyncio.create_task(ae.generate(input_ids=p, sampling_params=LONG)) for p in PROMPTS]
        while ae.stats.decode_tokens == 0:
            await asyncio.sleep(0.01)
        await ae.shutdown()
        outs = await asyncio.gather(*tasks)
        with pytest.raises(RuntimeError, match="shut down"):
            await ae.generate(input_ids=[1, 2], sampling_params=GREEDY)
        return outs

    outs = asyncio.run(run())
    assert all(o.outputs[0].finish_reason == "abort" for o in outs)


def test_queue_limit_and_bad_inputs_raise(engine):
    ae = AsyncEngine.from_engine(engine, max_queued_requests=2)
    try:

        async def run():
            tasks = [
                asyncio.create_task(ae.generate(input_ids=[5, 6], sampling_params=LONG)) for _ in range(3)
            ]
            done = await asyncio.gather(*tasks, return_exceptions=True)
            return done

        done = asyncio.run(run())
        assert sum(isinstance(d, Exception) and "max_queued_requests" in str(d) for d in done) == 1
        with pytest.raises(ValueError, match="vocabulary"):
            asyncio.run(ae.generate(input_ids=[10**9], sampling_params=GREEDY))
        assert asyncio.run(ae.generate(input_ids=[5], sampling_params=GREEDY)).outputs[0].token_ids
    finally:
        ae.close()
