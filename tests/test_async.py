"""AsyncEngine and ProcessAsyncEngine (the step loop in a thread / in a child process): many callers over
one step loop; abort, the pause modes, updates while paused, per-token weight versions, partial-rollout
resume, shutdown with requests in flight, a child that dies."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import replace

import pytest
import torch
from helpers import PROMPTS

from rollout import AsyncEngine, Engine, ProcessAsyncEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=True)
LONG = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return Engine(qwen3_dir, device="cpu", max_total_tokens=8192, page_size=4)


OPTIONS = dict(device="cpu", max_total_tokens=8192, page_size=4)


@pytest.fixture(scope="module")
def process_engine(qwen3_dir):
    ae = ProcessAsyncEngine(qwen3_dir, **OPTIONS)
    yield ae
    ae.close()


@pytest.fixture(params=["thread", "process"])
def aengine(request, engine):
    """The reference `engine` and an async engine over the same checkpoint: in thread mode it drives
    `engine` itself; in process mode a child's engine (one per module, its state checked clean)."""
    if request.param == "thread":
        ae = AsyncEngine.from_engine(engine)
        yield ae
        ae.close()
    else:
        ae = request.getfixturevalue("process_engine")
        yield ae
        assert ae.num_in_flight == 0
    assert ae.stats.requests == 0


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


def test_stream_interval_sends_the_first_at_once_then_every_n_tokens(engine, aengine, qwen3_dir):
    params = replace(GREEDY, max_new_tokens=23, n=2, temperature=0.8, seed=7)
    whole = engine.generate(input_ids=[PROMPTS[3]], sampling_params=params)[0]

    async def run():
        return [o async for o in aengine.stream(input_ids=PROMPTS[3], sampling_params=params)]

    aengine.stream_interval = 5
    try:
        outs = asyncio.run(run())
    finally:
        aengine.stream_interval = 1
    assert outs[-1].finished and len(outs) >= 3
    for o in outs[1:-1]:  # held back until a sample has 5 new tokens
        assert max(len(c.token_ids) for c in o.outputs) >= 5
    for c in whole.outputs:
        got = [d for o in outs for d in o.outputs if d.index == c.index]
        assert sum((d.token_ids for d in got), []) == c.token_ids
        assert "".join(d.text for d in got) == c.text
        assert sum((d.logprobs for d in got), []) == pytest.approx(c.logprobs, abs=1e-5)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="stream_interval"):
            AsyncEngine.from_engine(engine, stream_interval=bad)


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
        while aengine.stats.decode_tokens == 0 or not aengine.stats.requests:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert await aengine.abort("x")
        assert not await aengine.abort("x")
        return await task

    out = asyncio.run(run()).outputs[0]
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < LONG.max_new_tokens
    assert len(out.logprobs) == len(out.token_ids) == len(out.weight_versions)
    stats = aengine.stats
    assert stats.requests == 0 and stats.pages_free == stats.pages_total
    full = _greedy(engine, PROMPTS[1], LONG).token_ids
    assert out.token_ids == full[: len(out.token_ids)]


def test_pause_abort_ends_requests_and_allows_an_update(engine, aengine):
    before = engine.get_weights_by_name("lm_head.weight")  # equal in both engines

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
        stats = aengine.stats
        assert stats.running == 0 and stats.requests == 1
        v = await aengine.update_weights_from_tensor(_noisy_state(engine, 1))
        await aengine.continue_generation()
        got += [o async for o in stream]
        return got, v

    try:
        got, _ = asyncio.run(run())
    finally:
        asyncio.run(aengine.update_weights_from_tensor([("lm_head.weight", old)]))
    tokens = sum((o.outputs[0].token_ids for o in got), [])
    versions = sum((o.outputs[0].weight_versions for o in got), [])
    assert got[-1].outputs[0].finish_reason == "length" and len(tokens) == LONG.max_new_tokens
    assert len(versions) == len(tokens) and versions[0] < versions[-1]  # both versions sampled
    switch = versions.index(versions[-1])
    assert tokens[:switch] == reference[:switch] and tokens != reference  # new weights, new tokens


def test_in_place_pause_keeps_pages_and_refuses_updates(engine, aengine):
    # long enough that it cannot end between the stats read and the pause (the process mode's stats
    # are a round trip, and the module's engine has decoded before, so decode_tokens starts above 0)
    params = replace(GREEDY, max_new_tokens=200)

    async def run():
        before = aengine.stats.decode_tokens
        task = asyncio.create_task(aengine.generate(input_ids=PROMPTS[3], sampling_params=params))
        while aengine.stats.decode_tokens == before or not aengine.stats.requests:
            await asyncio.sleep(0.01)
        await aengine.pause_generation("in_place")
        steps = aengine.stats.steps
        await asyncio.sleep(0.1)
        stats = aengine.stats
        assert stats.steps == steps and stats.running == 1  # no step, pages kept
        with pytest.raises(RuntimeError, match="in flight"):
            await aengine.flush_cache() or await aengine.update_weights_from_tensor(_noisy_state(engine, 2))
        await aengine.continue_generation()
        return await task

    out = asyncio.run(run()).outputs[0]
    assert out.token_ids == _greedy(engine, PROMPTS[3], params).token_ids


def test_partial_rollout_resumes_without_recomputing_its_prefix(engine, aengine):
    full = _greedy(engine, PROMPTS[3], LONG).token_ids

    async def run():
        start = aengine.stats.decode_tokens
        task = asyncio.create_task(
            aengine.generate(input_ids=PROMPTS[3], sampling_params=LONG, request_id="p")
        )
        while aengine.stats.decode_tokens < start + 10:
            await asyncio.sleep(0.01)
        await aengine.abort("p")
        part = (await task).outputs[0].token_ids
        before = aengine.stats.prefill_tokens
        rest = SamplingParams(
            temperature=0.0, max_new_tokens=LONG.max_new_tokens - len(part), ignore_eos=True
        )
        tail = await aengine.generate(input_ids=PROMPTS[3] + part, sampling_params=rest)
        return part, tail.outputs[0].token_ids, aengine.stats.prefill_tokens - before

    part, tail, prefilled = asyncio.run(run())
    assert part + tail == full
    # only the tail is computed again: the last partial page (once, in a loaded full run, one page
    # more: 8 tokens at page_size 4; not yet explained), never the prompt
    assert prefilled <= 2 * engine.stats.page_size < len(PROMPTS[3])


@pytest.mark.parametrize("kind", [AsyncEngine, ProcessAsyncEngine])
def test_shutdown_with_requests_in_flight_aborts_them(qwen3_dir, kind):
    async def run():
        ae = kind(qwen3_dir, device="cpu", max_total_tokens=4096, page_size=4)
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


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_queue_limit_and_bad_inputs_raise(engine, qwen3_dir, mode):
    if mode == "thread":
        ae = AsyncEngine.from_engine(engine, max_queued_requests=2)
    else:
        ae = ProcessAsyncEngine(qwen3_dir, max_queued_requests=2, **OPTIONS)
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


def test_child_death_fails_pending_requests_and_calls_clearly(qwen3_dir):
    async def run():
        ae = ProcessAsyncEngine(qwen3_dir, **OPTIONS)
        tasks = [asyncio.create_task(ae.generate(input_ids=p, sampling_params=LONG)) for p in PROMPTS]
        while ae.stats.decode_tokens == 0:
            await asyncio.sleep(0.01)
        os.kill(ae.pid, signal.SIGKILL)
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        with pytest.raises(RuntimeError, match="died"):
            await ae.flush_cache()
        with pytest.raises(RuntimeError, match="died"):
            await ae.generate(input_ids=[1, 2], sampling_params=GREEDY)
        assert not ae.alive
        await ae.shutdown()
        return done

    done = asyncio.run(run())
    assert all(isinstance(d, RuntimeError) and "died (exit code -9)" in str(d) for d in done)


def test_process_stream_text_and_stop_strings_equal_thread_mode(engine, process_engine):
    """Text prompts are encoded and stream text decoded in the parent: the same deltas as the thread
    mode's (whose text comes from the engine), also where a stop string cuts the text (the cut comes
    from the child) and with n > 1; the tokens equal Engine.generate's."""
    free = SamplingParams(temperature=0.8, max_new_tokens=24, ignore_eos=True, n=3, seed=7)
    stop = engine.generate("ab c", free)[0].outputs[0].text[5:7]  # sample 0 (seeded) meets it
    params = replace(free, stop=[stop])
    want = engine.generate("ab c", params)[0]

    def per_sample(ae) -> dict:
        async def run():
            return [o async for o in ae.stream("ab c", params)]

        outs = asyncio.run(run())
        assert outs[-1].finished and outs[-1].prompt == "ab c"
        assert outs[0].prompt_token_ids == engine.tokenizer.encode("ab c")
        got = {}
        for c in want.outputs:
            mine = [d for o in outs for d in o.outputs if d.index == c.index]
            last = mine[-1]
            got[c.index] = (sum((d.token_ids for d in mine), []), "".join(d.text for d in mine), last)
        return got

    thread = AsyncEngine.from_engine(engine)
    try:
        expected = per_sample(thread)
    finally:
        thread.close()
    got = per_sample(process_engine)
    for c in want.outputs:
        tokens, text, last = got[c.index]
        assert tokens == c.token_ids and text == expected[c.index][1]
        # a stream never shows what a stop string later cuts: joined, it is the whole output's text
        assert text == c.text
        assert (last.finish_reason, last.stop_reason) == (c.finish_reason, c.stop_reason)
    assert any(c.stop_reason == stop for c in want.outputs)


@pytest.mark.parametrize("kind", [AsyncEngine, ProcessAsyncEngine])
def test_streams_under_the_overlap_schedule_equal_engine_generate(engine, qwen3_dir, kind):
    """With overlap_schedule the step in flight holds a placeholder token: no stream may show it."""
    want = [_greedy(engine, p, LONG) for p in PROMPTS[:3]]
    ae = kind(qwen3_dir, overlap_schedule=True, **OPTIONS)

    async def one(prompt):
        return [o async for o in ae.stream(input_ids=prompt, sampling_params=LONG)]

    async def run():
        return await asyncio.gather(*(one(p) for p in PROMPTS[:3]))

    try:
        got = asyncio.run(run())
    finally:
        ae.close()
    for outs, w in zip(got, want):
        assert sum((o.outputs[0].token_ids for o in outs), []) == w.token_ids
        assert sum((o.outputs[0].logprobs for o in outs), []) == pytest.approx(w.logprobs, abs=1e-5)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"


def test_a_busy_caller_loop_gets_fewer_larger_updates(process_engine):
    """While the callers' event loop is busy, the child's steps gather into fewer updates (each sent
    once the last was taken, or after ACK_AFTER_S): fewer than the steps, and every token still comes.
    A property read from inside the loop meanwhile is answered (answers never wait for the ACK)."""
    from rollout.fronts import async_process

    applied = []
    apply = process_engine._apply

    def counting(update):
        applied.append(time.monotonic())
        apply(update)

    process_engine._apply = counting  # the reader thread calls it per update
    params = SamplingParams(temperature=0.0, max_new_tokens=160, ignore_eos=True)

    async def run():
        outs, busy = [], None
        async for out in process_engine.stream(input_ids=PROMPTS[0], sampling_params=params):
            outs.append(out)
            if busy is None:  # the loop runs nothing else for a while: the steps go on
                steps0 = process_engine.stats.steps  # a blocking read from inside the loop
                t0 = time.monotonic()
                time.sleep(0.8)
                busy = (t0, time.monotonic(), process_engine.stats.steps - steps0)
        return outs, busy

    try:
        outs, (t0, t1, steps) = asyncio.run(run())
    finally:
        del process_engine._apply
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 160 and outs[-1].finished
    during = sum(t0 <= t < t1 for t in applied)
    assert steps >= 20, f"only {steps} steps in 0.8 s: the test cannot tell gathering apart"
    # one update per ACK_AFTER_S at most (the loop never ran its callers), plus the ones in flight
    assert during <= 0.8 / async_process.ACK_AFTER_S + 3 < steps, (during, steps)
