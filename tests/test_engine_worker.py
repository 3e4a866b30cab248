"""The engine worker (ProcessAsyncEngine's child loop), run in a thread over a real pipe: a parent that
stops reading must not stop the steps, and what it reads later still adds up to each request's output."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

from rollout import Engine, SamplingParams
from rollout.process import worker as W
from rollout.process.wire import CLOSE, Call

REQUESTS, TOKENS = 24, 80
# 20 top logprobs per token make each step's deltas large (about 7 kB): the updates overflow the pipe's
# socket buffer (about 200 kB) long before the end
PARAMS = SamplingParams(
    temperature=0.0, max_new_tokens=TOKENS, ignore_eos=True, logprobs=True, top_logprobs=20
)


def test_a_parent_that_stops_reading_does_not_stop_the_steps(qwen3_dir):
    engine = Engine(qwen3_dir, device="cpu", max_total_tokens=8192, page_size=4)
    parent, child = mp.Pipe()
    worker = threading.Thread(target=W._Worker(child, engine).loop, daemon=True)
    worker.start()
    vocab = engine.model_config.vocab_size
    prompts = [[(7 * i + j) % (vocab - 1) + 1 for j in range(6 + i % 5)] for i in range(REQUESTS)]
    parent.send([Call(i + 1, W.ADD, (f"r{i}", p, PARAMS, True), {}) for i, p in enumerate(prompts)])
    deadline = time.monotonic() + 120
    while engine.has_unfinished() or not engine.stats.steps:  # the parent reads nothing meanwhile
        assert time.monotonic() < deadline, "the steps waited for the parent to read"
        time.sleep(0.05)
    streamed: dict[tuple[str, int], list[int]] = {}
    finals, updates = {}, 0
    while len(finals) < REQUESTS:
        update = parent.recv()
        parent.send([Call(0, W.ACK, (), {})])  # the next update goes once this one is taken
        updates += 1
        assert all(r.ok for r in update.replies), [r.value for r in update.replies if not r.ok]
        for d in update.tokens:
            streamed.setdefault((d.request_id, d.sample), []).extend(d.token_ids)
        finals |= {out.request_id: out for out in update.finished}
    parent.send([Call(0, CLOSE, (), {})])
    worker.join(30)
    assert not worker.is_alive()
    # fewer updates than steps: while one waited for its ACK, the next gathered the steps behind it
    assert updates < engine.stats.steps
    for rid, out in finals.items():
        whole = out.outputs[0].token_ids
        assert len(whole) == TOKENS
        assert whole[: len(streamed.get((rid, 0), []))] == streamed.get((rid, 0), [])
    engine.shutdown()


def test_token_deltas_refuses_bad_counts_and_the_engine_goes_on(qwen3_dir):
    engine = Engine(qwen3_dir, device="cpu", max_total_tokens=1024, page_size=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True, n=2)
    engine.add_request("a", [1, 2, 3], params)
    engine.step()
    engine.step()  # both samples have tokens now
    for bad in ([0], [0, -1], [0, 1.0], [0, True], (0, 0)):
        with pytest.raises(ValueError, match=r"sent\['a'\]"):
            engine.token_deltas({"a": bad})
    deltas = engine.token_deltas({"a": [0, 0], "gone": [0]})  # a request not in flight is skipped
    assert sorted(d.sample for d in deltas) == [0, 1] and all(d.token_ids for d in deltas)
    sent = [len(d.token_ids) for d in sorted(deltas, key=lambda d: d.sample)]
    assert engine.token_deltas({"a": sent}) == []  # nothing past what was sent
    while engine.has_unfinished():
        engine.step()
    assert not engine.has_unfinished("a")
    engine.shutdown()


def test_an_update_crosses_the_pipe_whole():
    """Updates pickle their deltas as plain tuples (faster in the worker); the parent gets TokenDeltas."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from rollout.outputs import TokenDelta
    from rollout.process.wire import Reply, Update

    deltas = [
        TokenDelta("a", 0, [5, 6], [-0.5, -1.5], None, [0, 1], None, None, None),
        TokenDelta(("b", 2), 1, [7], None, [{7: -0.1, 8: -2.0}], [1], "stop", "</s>", "ab"),
    ]
    update = Update(replies=[Reply(3, True, {"x": 1})], tokens=deltas, failed=["c"])
    back = pickle.loads(ForkingPickler.dumps(update))
    assert back == update and all(type(d) is TokenDelta for d in back.tokens)
    assert back.replies[0].value == {"x": 1} and back.failed == ["c"]


def test_the_sender_never_waits_for_a_parent_that_stops_reading():
    """Small updates are written at once while the socket has room; once it has none (the parent reads
    nothing), and for large ones, the thread writes: `send` returns at once either way, and the parent
    later reads every update whole and in order."""
    from rollout.outputs import TokenDelta
    from rollout.process.wire import Update

    def update(rid: str, n: int) -> Update:
        return Update(tokens=[TokenDelta(rid, 0, list(range(n)), None, None, [0] * n, None, None, None)])

    parent, child = mp.Pipe()
    sender = W._Sender(child)
    sent, deadline = [], time.monotonic() + 30
    while sender.free(wait=False):  # the socket fills up with small updates, then the thread blocks
        assert time.monotonic() < deadline, "the socket never filled"
        sent.append(update(f"r{len(sent)}", 500))
        t = time.monotonic()
        sender.send(sent[-1])
        assert time.monotonic() - t < 1.0, "send waited for the parent"
    assert len(sent) > 3  # some went at once before the thread took one
    got = [parent.recv() for _ in sent]  # reading lets the thread finish
    assert sender.free(wait=True)
    big = update("big", W.DIRECT_BYTES)
    sender.send(big)  # larger than DIRECT_BYTES: the thread's
    got.append(parent.recv())
    assert got == [*sent, big]
    sender.close()
