"""Several fronts over one engine process (ProcessAsyncEngine.listen / attach, what the server's
--api-server-count runs): each front's requests and streams are its own and equal Engine.generate;
aborts act on the engine whoever sends them; a front that closes or dies loses only its own requests;
a wrong key is refused; the engine ends with the front that started it."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import socket
from multiprocessing.connection import AuthenticationError

import pytest
from helpers import PROMPTS

from rollout import Engine, ProcessAsyncEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=True)
LONG = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
OPTIONS = dict(device="cpu", max_total_tokens=8192, page_size=4)


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    engine = Engine(qwen3_dir, **OPTIONS)
    yield {tuple(p): engine.generate(input_ids=[p], sampling_params=GREEDY)[0].outputs[0] for p in PROMPTS}
    engine.shutdown()


@pytest.fixture
def owner(qwen3_dir):
    front = ProcessAsyncEngine(qwen3_dir, **OPTIONS)
    yield front
    front.close()


async def _stream(front, prompt, params=GREEDY, rid=None):
    """The streamed deltas joined: token ids, logprobs, the last finish reason."""
    ids, lps, reason = [], [], None
    async for out in front.stream(input_ids=prompt, sampling_params=params, request_id=rid):
        c = out.outputs[0]
        ids += c.token_ids
        lps += c.logprobs or []
        reason = c.finish_reason or reason
    return ids, lps, reason


def test_two_fronts_stream_concurrently_and_equal_engine_generate(owner, reference):
    address, key = owner.listen()
    assert owner.listen() == (address, key)  # one socket, however often asked
    other = ProcessAsyncEngine.attach(address, key)
    try:
        assert other.pid == owner.pid and other.model_path == owner.model_path
        assert other.max_model_len == owner.max_model_len

        async def main():
            jobs = [_stream(f, p) for p in PROMPTS for f in (owner, other)]
            jobs += [f.generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS for f in (owner, other)]
            return await asyncio.gather(*jobs)

        results = asyncio.run(main())
        streamed, whole = results[: 2 * len(PROMPTS)], results[2 * len(PROMPTS) :]
        for i, (ids, lps, reason) in enumerate(streamed):
            want = reference[tuple(PROMPTS[i // 2])]
            assert ids == want.token_ids and reason == "length"
            assert lps == pytest.approx(want.logprobs, abs=1e-5)
        for i, out in enumerate(whole):
            assert out.outputs[0].token_ids == reference[tuple(PROMPTS[i // 2])].token_ids
        assert owner.stats.requests == 0 and other.stats.requests == 0
    finally:
        other.close()


def test_an_abort_from_one_front_ends_the_other_fronts_request(owner):
    other = ProcessAsyncEngine.attach(*owner.listen())
    try:

        async def main():
            task = asyncio.create_task(_stream(owner, PROMPTS[0], LONG, rid="theirs"))
            while not owner.stats.requests:
                await asyncio.sleep(0.01)
            assert await other.abort("theirs") is True
            assert await other.abort("theirs") is False  # no longer in flight
            return await task

        ids, _, reason = asyncio.run(main())
        assert reason == "abort" and 0 < len(ids) < LONG.max_new_tokens
    finally:
        other.close()


def test_a_front_that_closes_loses_only_its_own_requests(owner, reference):
    other = ProcessAsyncEngine.attach(*owner.listen())

    async def main():
        mine = asyncio.create_task(_stream(other, PROMPTS[1], LONG))
        theirs = asyncio.create_task(_stream(owner, PROMPTS[0], LONG))
        while owner.stats.requests < 2:
            await asyncio.sleep(0.01)
        await other.shutdown()  # detaches: its request ends as aborted, with what it has
        return await mine, await theirs

    (mine, _, mine_reason), (theirs, _, theirs_reason) = asyncio.run(main())
    assert mine_reason == "abort" and len(mine) < LONG.max_new_tokens
    assert theirs_reason == "length" and len(theirs) == LONG.max_new_tokens
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(other.generate(input_ids=PROMPTS[0], sampling_params=GREEDY))
    out = asyncio.run(owner.generate(input_ids=PROMPTS[2], sampling_params=GREEDY))
    assert out.outputs[0].token_ids == reference[tuple(PROMPTS[2])].token_ids
    assert owner.stats.requests == 0


def _attached_child(address: str, key: bytes, prompt: list[int], ready) -> None:
    front = ProcessAsyncEngine.attach(address, key)

    async def main():
        task = asyncio.create_task(front.generate(input_ids=prompt, sampling_params=LONG))
        while not front.stats.requests:
            await asyncio.sleep(0.01)
        ready.set()
        await task

    asyncio.run(main())


def test_a_front_process_that_dies_loses_only_its_own_requests(owner, reference):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_attached_child, args=(*owner.listen(), PROMPTS[1], ready))
    child.start()
    try:
        assert ready.wait(120), "the attached process did not start its request"
        asyncio.run(owner.pause_generation("in_place"))  # no step runs: its request cannot finish
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)

        async def main():
            while owner.stats.requests:  # the dead front's request is aborted once its link drops
                await asyncio.sleep(0.01)
            await owner.continue_generation()
            return await owner.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)

        out = asyncio.run(asyncio.wait_for(main(), 120))
        assert out.outputs[0].token_ids == reference[tuple(PROMPTS[0])].token_ids
    finally:
        if child.is_alive():
            child.kill()


def test_a_wrong_key_is_refused_and_the_engine_goes_on(owner, reference):
    address, key = owner.listen()
    with pytest.raises(AuthenticationError):
        ProcessAsyncEngine.attach(address, b"not the key")
    with socket.socket(socket.AF_UNIX) as s:  # a client that leaves during the handshake
        s.connect(address)
    out = asyncio.run(owner.generate(input_ids=PROMPTS[0], sampling_params=GREEDY))
    assert out.outputs[0].token_ids == reference[tuple(PROMPTS[0])].token_ids
    ProcessAsyncEngine.attach(address, key).close()  # the right key still gets in


def test_the_engine_ends_with_the_front_that_started_it(qwen3_dir):
    owner = ProcessAsyncEngine(qwen3_dir, **OPTIONS)
    other = ProcessAsyncEngine.attach(*owner.listen())

    async def main():
        task = asyncio.create_task(_stream(other, PROMPTS[0], LONG))
        while not other.stats.requests:
            await asyncio.sleep(0.01)
        await owner.shutdown()  # every request in flight ends as aborted, then the engine stops
        return await task

    ids, _, reason = asyncio.run(main())
    assert reason == "abort" and len(ids) < LONG.max_new_tokens
    with pytest.raises(RuntimeError, match="closed the connection"):
        asyncio.run(other.generate(input_ids=PROMPTS[0], sampling_params=GREEDY))
    assert not other.alive
    other.close()
