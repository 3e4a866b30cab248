"""The two async fronts have one surface (rollout/serve/app.py takes either), and the deltas that queue
up for a slow caller merge into one."""

from __future__ import annotations

import inspect

from rollout import AsyncEngine, ProcessAsyncEngine
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.stream_deltas import cut, merge


def _public(cls: type) -> dict[str, object]:
    return {n: getattr(cls, n) for n in dir(cls) if not n.startswith("_")}


def test_process_front_has_the_thread_fronts_methods_and_signatures():
    thread, proc = _public(AsyncEngine), _public(ProcessAsyncEngine)
    missing = set(thread) - set(proc) - {"from_engine", "engine"}
    assert not missing
    for name, member in thread.items():
        if callable(member) and name in proc and name != "from_engine":
            assert inspect.signature(member) == inspect.signature(proc[name]), name
            assert inspect.iscoroutinefunction(member) == inspect.iscoroutinefunction(proc[name]), name


def _c(index, tokens, text, finish=None, stop=None):
    return CompletionOutput(index, tokens, text, [0.5] * len(tokens), None, finish, stop, [1] * len(tokens))


def test_merge_joins_each_samples_deltas_and_keeps_the_last_facts():
    a = RequestOutput([1, 2], [_c(0, [5], "a"), _c(1, [6], "b")], request_id="r", finished=False)
    b = RequestOutput([1, 2], [_c(1, [7, 8], "cd", "stop", "cd")], request_id="r", finished=False)
    c = RequestOutput([1, 2], [_c(0, [9], "e", "length"), _c(1, [], "")], request_id="r", finished=True)
    m = merge([a, b, c])
    assert m.finished and [o.index for o in m.outputs] == [0, 1]
    s0, s1 = m.outputs
    assert (s0.token_ids, s0.text, s0.finish_reason) == ([5, 9], "ae", "length")
    assert (s1.token_ids, s1.text, s1.finish_reason, s1.stop_reason) == ([6, 7, 8], "bcd", "stop", "cd")
    assert s1.logprobs == [0.5] * 3 and s1.weight_versions == [1] * 3
    assert merge([a]) is a


def test_cut_drops_what_was_streamed():
    whole = _c(0, [5, 6, 7], "xyz", "abort")
    rest = cut(whole, 2, 1)
    assert (rest.token_ids, rest.text, rest.logprobs, rest.weight_versions) == ([7], "yz", [0.5], [1])
    assert rest.finish_reason == "abort"
