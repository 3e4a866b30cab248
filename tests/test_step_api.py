"""The request-level core: add_request / step / abort_request / has_unfinished, driven by hand; the one
list of public methods and EngineProcess's parity with it; concurrent callers."""

from __future__ import annotations

import inspect
import threading
import time

import pytest
from helpers import PROMPTS

from rollout import Engine, EngineProcess, SamplingParams
from rollout.api import BUCKETED_TENSOR_ARGS, CONSTANT_PROPERTIES, ENGINE_METHODS, ENGINE_PROPERTIES

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, ignore_eos=True, seed=7, n=2)


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return Engine(qwen3_dir, device="cpu", max_total_tokens=4096, page_size=4)


def _tokens(outs) -> list[list[list[int]]]:
    return [[s.token_ids for s in o.outputs] for o in outs]


def test_hand_driven_steps_with_arrivals_equal_generate(engine):
    params = [GREEDY if i % 2 else SEEDED for i in range(len(PROMPTS))]
    expected = engine.generate(input_ids=PROMPTS, sampling_params=params)
    ran = engine.last_stats
    assert 0 < ran["step_seconds"] <= ran["seconds"]  # generate's loop is its steps
    done, arrivals = {}, list(enumerate(zip(PROMPTS, params)))
    engine.add_request(*_arrival(arrivals.pop(0)))
    steps, inside, before = 0, 0.0, engine.stats.step_seconds
    while engine.has_unfinished() or arrivals:
        t0 = time.perf_counter()
        outs = engine.step()
        inside += time.perf_counter() - t0
        for out in outs:
            assert out.finished and out.request_id not in done
            done[out.request_id] = out
        steps += 1
        if arrivals and steps % 3 == 0:  # new requests join while others run
            engine.add_request(*_arrival(arrivals.pop(0)))
    assert engine.stats.step_seconds - before == pytest.approx(inside, rel=0.05, abs=1e-3)
    got = [done[f"r{i}"] for i in range(len(PROMPTS))]
    assert _tokens(got) == _tokens(expected)
    for o, e in zip(got, expected):  # other batch mates: the same tokens, logprobs to float rounding
        if e.outputs[0].logprobs is not None:
            assert o.outputs[0].logprobs == pytest.approx(e.outputs[0].logprobs, abs=1e-5)
    assert engine.stats.requests == 0 and engine.stats.pages_free == engine.stats.pages_total


def _arrival(item):
    i, (prompt, p) = item
    return f"r{i}", prompt, p


def test_stream_deltas_add_up_to_the_whole_output(engine):
    # both runs prefill from an empty cache (an earlier test cached this prompt, computed in another
    # batch), so their logprobs are bit-equal, not just close
    engine.flush_cache()
    whole = engine.generate(input_ids=[PROMPTS[0]], sampling_params=GREEDY)[0].outputs[0]
    engine.flush_cache()
    engine.add_request("s", PROMPTS[0], GREEDY, stream=True)
    tokens, logprobs, text, outs = [], [], "", []
    while engine.has_unfinished():
        for out in engine.step():
            outs.append(out)
            tokens += out.outputs[0].token_ids
            logprobs += out.outputs[0].logprobs
            text += out.outputs[0].text
    assert len(outs) == len(whole.token_ids)  # one delta per decoded token
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert tokens == whole.token_ids and logprobs == whole.logprobs and text == whole.text
    assert outs[-1].outputs[0].finish_reason == "length"


def test_abort_request_returns_partial_output_and_frees_pages(engine):
    engine.add_request("a", PROMPTS[3], GREEDY)
    engine.add_request("b", PROMPTS[1], GREEDY)
    for _ in range(4):
        engine.step()
    out = engine.abort_request("a")
    assert out.request_id == "a" and out.outputs[0].finish_reason == "abort"
    assert 0 < len(out.outputs[0].token_ids) < GREEDY.max_new_tokens
    assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
    assert engine.abort_request("a") is None  # gone
    rest = []
    while engine.has_unfinished():
        rest += engine.step()
    assert [o.request_id for o in rest] == ["b"] and rest[0].outputs[0].finish_reason == "length"
    assert engine.stats.pages_free == engine.stats.pages_total


def test_request_errors_name_the_field_and_leave_the_engine_usable(engine):
    with pytest.raises(TypeError, match="request_id"):
        engine.add_request(1.5, [1, 2], GREEDY)
    with pytest.raises(TypeError, match="input_ids"):
        engine.add_request("x", [[1, 2]], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("x", [10**9], GREEDY)
    engine.add_request("dup", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("dup", [1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.generate(input_ids=[[1, 2]], sampling_params=GREEDY)
    engine.abort_request("dup")
    assert engine.step() == [] and not engine.has_unfinished()
    assert len(engine.generate(input_ids=[[1, 2]], sampling_params=GREEDY)[0].outputs[0].token_ids) == 12


def test_concurrent_generate_calls_are_serialised_and_correct(engine):
    expected = _tokens(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    results, errors = {}, []

    def worker(k: int) -> None:
        try:
            results[k] = _tokens(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(r == expected for r in results.values()) and len(results) == 4


def test_shutdown_refuses_later_calls(qwen3_dir):
    with Engine(qwen3_dir, device="cpu", max_total_tokens=256) as e:
        e.add_request("x", [1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate(input_ids=[[1, 2]], sampling_params=GREEDY)
    e.shutdown()  # twice is fine


# -- one list of public methods ----------------------------------------------------------------------
def test_the_api_list_names_every_public_method_and_property():
    public = {n for n in dir(Engine) if not n.startswith("_")}
    methods = {n for n in public if callable(getattr(Engine, n))}
    props = {n for n in public if isinstance(getattr(Engine, n), property)}
    assert methods == set(ENGINE_METHODS)
    assert props == set(ENGINE_PROPERTIES)


def test_the_declared_constants_and_tensor_arguments_name_the_api():
    """The process forms read these declarations: a constant is a property the start-up facts carry,
    a bucketed method's two arguments are parameters of its Engine signature."""
    assert set(CONSTANT_PROPERTIES) <= set(ENGINE_PROPERTIES)
    for method, (pairs, fmt) in BUCKETED_TENSOR_ARGS.items():
        assert method in ENGINE_METHODS
        assert {pairs, fmt} <= set(inspect.signature(getattr(Engine, method)).parameters)


@pytest.mark.parametrize("name", ENGINE_METHODS)
def test_engine_process_has_each_method_with_the_same_signature(name):
    assert inspect.signature(getattr(EngineProcess, name)) == inspect.signature(getattr(Engine, name))


@pytest.mark.parametrize("name", ENGINE_PROPERTIES)
def test_engine_process_has_each_property(name):
    assert isinstance(getattr(EngineProcess, name), property)


def test_engine_process_drives_the_step_loop(qwen3_dir):
    local = Engine(qwen3_dir, device="cpu", max_total_tokens=1024)
    expected = _tokens(local.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY))
    with EngineProcess(qwen3_dir, device="cpu", max_total_tokens=1024) as proc:
        for i, prompt in enumerate(PROMPTS[:2]):
            proc.add_request(i, prompt, GREEDY)
        done = {}
        while proc.has_unfinished():
            done.update({o.request_id: o for o in proc.step()})
        assert _tokens([done[0], done[1]]) == expected
        assert (
            proc.stats.requests == 0 and proc.last_stats == {} and proc.max_model_len == local.max_model_len
        )
