"""The two async fronts have one surface (rollout/serve/app.py takes either), and the deltas that queue
up for a slow caller merge into one."""

from __future__ import annotations

import inspect

from rollout import AsyncEngine, ProcessAsyncEngine
from rollout.fronts.stream_deltas import StreamedText, cut, merge
from rollout.outputs import CompletionOutput, RequestOutput, TokenDelta


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


def _steps(rid: str, stop_text: str) -> list[list[TokenDelta]]:
    """Two samples over four steps; sample 1 ends on a stop string at its third token."""
    steps = []
    for k in range(4):
        step = [TokenDelta(rid, 0, [40 + k, 50 + k], [-0.1, -0.2], None, [k, k], None, None, None)]
        if k < 3:
            end = k == 2
            stop = ("stop", "xy", stop_text) if end else (None, None, None)
            step.append(TokenDelta(rid, 1, [60 + k], [-0.3], None, [k], *stop))
        steps.append(step)
    return steps


def _text(tokenizer, holdback: int) -> StreamedText:
    return StreamedText([1, 2, 3], None, tokenizer, True, holdback)


def test_deltas_that_queued_up_decode_as_one_equal_to_step_by_step():
    from transformers import AutoTokenizer

    from rollout.models.toy import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    # the text a stop string leaves: here what its tokens decode to (the text already shown is a
    # prefix of it, as the engine's holdback ensures)
    two, stop_text = tok.decode([60, 61]), tok.decode([60, 61, 62])
    assert stop_text.startswith(two) and len(stop_text) > len(two)
    for holdback in (0, 3):
        steps = _steps("r", stop_text)
        a, b = _text(tok, holdback), _text(tok, holdback)
        one_by_one = merge([a.tokens(s) for s in steps])
        queued = b.tokens([d for s in steps for d in s])
        assert [c.index for c in queued.outputs] == [0, 1]
        for x, y in zip(one_by_one.outputs, queued.outputs):
            assert (x.token_ids, x.text, x.logprobs, x.weight_versions) == (
                y.token_ids, y.text, y.logprobs, y.weight_versions
            )  # fmt: skip
            assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        assert queued.outputs[1].text == stop_text and queued.outputs[1].token_ids == [60, 61, 62]
        assert queued.outputs[0].token_ids == [40, 50, 41, 51, 42, 52, 43, 53]
        assert {i: (s.tokens, s.chars) for i, s in a.samples.items()} == {
            i: (s.tokens, s.chars) for i, s in b.samples.items()
        }
