"""The overlap schedule (EngineConfig.overlap_schedule): step k+1 is launched before step k's tokens are
collected. Outputs must equal the plain schedule's in every case: stops of every kind, aborts, retracts,
n > 1 prefix sharing, weight updates between steps. On a CPU the device work runs at launch, so a
`Deferred` runner is also used: it queues each step's work and runs it only when the step is
collected or its tokens are read, as a GPU stream would, so a boundary that forgot to collect the step
in flight would compute it with what changed after it."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS

from rollout import Engine, SamplingParams
from rollout.runner.model_runner import Launched

ENGINE = dict(device="cpu", max_total_tokens=4096, page_size=4)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=True)


def engines(path: str, **options) -> tuple[Engine, Engine]:
    return Engine(path, **ENGINE, **options), Engine(path, **ENGINE, overlap_schedule=True, **options)


@pytest.fixture(scope="module")
def pair(qwen3_dir):
    return engines(qwen3_dir)


def outputs(outs) -> list:
    return [
        [(c.token_ids, c.finish_reason, c.stop_reason, c.text, c.weight_versions) for c in o.outputs]
        for o in outs
    ]


def mixed_params(eos: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_new_tokens=3, logprobs=True),
        SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=14, seed=5, n=3, logprobs=True),
        SamplingParams(temperature=0.0, max_new_tokens=30, stop=["a", "b", "1"]),
        SamplingParams(temperature=1.0, max_new_tokens=1, seed=2),
        SamplingParams(temperature=0.8, top_k=5, max_new_tokens=20, seed=9, stop_token_ids=[eos + 3, 7]),
    ]


def test_generate_equals_the_plain_schedule(pair):
    plain, overlap = pair
    params = mixed_params(eos=2)
    a = plain.generate(input_ids=PROMPTS, sampling_params=params)
    b = overlap.generate(input_ids=PROMPTS, sampling_params=params)
    assert outputs(a) == outputs(b)
    for x, y in zip(a, b):
        for p, q in zip(x.outputs, y.outputs):
            if p.logprobs is not None:
                assert q.logprobs == pytest.approx(p.logprobs, abs=1e-5)
    for e in pair:
        assert e.stats.requests == 0 and e.stats.pages_free == e.stats.pages_total


def test_eos_stops_and_the_extra_token_is_never_emitted(pair):
    plain, overlap = pair
    params = SamplingParams(
        temperature=1.0, max_new_tokens=40, seed=11, n=4
    )  # eos (2) is sampled now and then
    a = plain.generate(input_ids=PROMPTS, sampling_params=params)
    b = overlap.generate(input_ids=PROMPTS, sampling_params=params)
    assert outputs(a) == outputs(b)
    assert any(c.finish_reason == "stop" for o in a for c in o.outputs)


def drive(engine: Engine, arrivals: list, abort_at: dict[int, str], retract_at: set[int]) -> dict:
    """add_request / step / abort_request by hand: request i arrives at step 2i; returns every output."""
    done, step = {}, 0
    while engine.has_unfinished() or arrivals:
        if arrivals and step % 2 == 0:
            engine.add_request(*arrivals.pop(0))
        if step in abort_at:
            out = engine.abort_request(abort_at[step])
            if out is not None:
                done[out.request_id] = out
        if step in retract_at:
            engine.retract_requests()
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return done


def test_hand_driven_arrivals_aborts_and_retracts_equal_the_plain_schedule(pair):
    runs = []
    for engine in pair:
        params = mixed_params(eos=2)
        arrivals = [(f"r{i}", p, params[i % len(params)]) for i, p in enumerate(PROMPTS * 2)]
        done = drive(engine, arrivals, abort_at={5: "r1", 9: "r4", 12: "r0"}, retract_at={7, 15})
        runs.append({rid: outputs([o]) for rid, o in done.items()})
        assert engine.stats.requests == 0 and engine.stats.pages_free == engine.stats.pages_total
    assert runs[0] == runs[1]
    assert runs[0]["r1"][0][0][1] == "abort"


def test_streamed_deltas_add_up_to_the_plain_output(pair):
    plain, overlap = pair
    p = SamplingParams(temperature=1.0, max_new_tokens=15, seed=4, stop=["c"], logprobs=True)
    whole = plain.generate(input_ids=[PROMPTS[0]], sampling_params=p)[0].outputs[0]
    overlap.add_request("s", PROMPTS[0], p, stream=True)
    tokens, text, last = [], "", None
    while overlap.has_unfinished():
        for out in overlap.step():
            tokens += out.outputs[0].token_ids
            text += out.outputs[0].text
            last = out
    assert last.finished and tokens == whole.token_ids and text == whole.text


def test_preemption_under_a_small_pool_equals_the_plain_schedule(qwen3_dir):
    small = dict(device="cpu", page_size=4, max_total_tokens=96)
    plain, overlap = Engine(qwen3_dir, **small), Engine(qwen3_dir, **small, overlap_schedule=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (9, 5, 12, 7, 3)]
    a = plain.generate(input_ids=prompts, sampling_params=params)
    b = overlap.generate(input_ids=prompts, sampling_params=params)
    assert plain.stats.preemptions > 0 and overlap.stats.preemptions > 0
    assert outputs(a) == outputs(b)
    assert overlap.stats.pages_free == overlap.stats.pages_total


def test_penalties_and_min_tokens_read_the_collected_tokens(pair):
    plain, overlap = pair
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=12, seed=1, repetition_penalty=1.5, min_tokens=4),
        SamplingParams(temperature=1.0, max_new_tokens=12, seed=2, frequency_penalty=0.7, n=2),
    ]
    prompts = PROMPTS[:2]
    assert outputs(plain.generate(input_ids=prompts, sampling_params=params)) == outputs(
        overlap.generate(input_ids=prompts, sampling_params=params)
    )


def test_prompt_logprobs_and_score_are_unchanged(pair):
    plain, overlap = pair
    p = SamplingParams(temperature=0.0, max_new_tokens=4, prompt_logprobs=2, n=2)
    a = plain.generate(input_ids=PROMPTS[:3], sampling_params=p)
    b = overlap.generate(input_ids=PROMPTS[:3], sampling_params=p)
    assert outputs(a) == outputs(b)
    for x, y in zip(a, b):
        assert y.prompt_logprobs == pytest.approx(x.prompt_logprobs, abs=1e-5)
    sa, sb = plain.score(input_ids=PROMPTS[:3]), overlap.score(input_ids=PROMPTS[:3])
    for x, y in zip(sa, sb):
        assert y.logprobs == pytest.approx(x.logprobs, abs=1e-5)


# -- boundaries: the step in flight is collected first ---------------------------------------------------
class Deferred:
    """Wraps a runner's `launch` so the step's work runs only when it is collected or its tokens are
    read, like kernels queued on a GPU stream (on a CPU they would otherwise run at launch)."""

    def __init__(self, runner):
        self.runner, self.launch = runner, runner.launch
        runner.launch = self.deferred_launch

    def deferred_launch(self, batch, prev=None):
        snapshot = [(s, s.num_computed, len(s.token_ids)) for s in batch.seqs]
        # which rows sample is host knowledge: known at launch without running anything
        sampled = [
            i for i, (s, c) in enumerate(zip(batch.seqs, batch.chunks)) if s.num_computed + c == s.num_tokens
        ]
        seq_ids = [batch.seqs[i].seq_id for i in sampled]
        return _Lazy(lambda: self._run(batch, prev, snapshot), sampled, seq_ids)

    def _run(self, batch, prev, snapshot):
        # the step as it was launched: its sequences' counts then (accounting has moved them since)
        now = [(s.num_computed, list(s.token_ids), s.pending) for s, _, _ in snapshot]
        for s, computed, length in snapshot:
            s.num_computed, s.token_ids[:] = computed, s.token_ids[:length]
        try:
            return self.launch(batch, prev._force() if isinstance(prev, _Lazy) else prev)
        finally:
            for (s, _, _), (computed, tokens, pending) in zip(snapshot, now):
                s.num_computed, s.token_ids[:], s.pending = computed, tokens, pending


class _Lazy(Launched):
    def __init__(self, run, sampled: list[int], seq_ids: list[int]):
        self._run, self._done = run, None
        super().__init__(sampled=sampled, seq_ids=seq_ids)

    def _force(self) -> Launched:
        if self._done is None:
            self._done = self._run()
            assert (self._done.sampled, self._done.seq_ids) == (self.sampled, self.seq_ids)
        return self._done

    def __getattribute__(self, name):
        if name == "tokens":  # the device results: running late, as a GPU would
            return self._force().tokens
        return super().__getattribute__(name)

    def collect(self):
        return self._force().collect()


def noisy_head(engine: Engine, seed: int) -> list[tuple[str, torch.Tensor]]:
    head = engine.get_weights_by_name("lm_head.weight")
    noise = torch.randn(head.shape, generator=torch.Generator().manual_seed(seed)) * head.std()
    return [("lm_head.weight", head + noise)]


def test_a_weight_update_between_steps_affects_exactly_the_steps_after_it(qwen3_dir):
    """Retract, update, resume, by hand, on a runner whose work runs late: the steps launched before
    the update are computed with the old weights and tagged with the old version."""
    runs = []
    for overlap in (False, True):
        engine = Engine(qwen3_dir, **ENGINE, overlap_schedule=overlap)
        Deferred(engine.runner)
        update = noisy_head(engine, seed=3)
        engine.add_request("a", PROMPTS[0], GREEDY)
        engine.add_request("b", PROMPTS[1], GREEDY)
        done = {}
        for _ in range(6):
            done.update((o.request_id, o) for o in engine.step())
        engine.retract_requests()
        engine.update_weights_from_tensor(update)
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step())
        runs.append({rid: outputs([o]) for rid, o in done.items()})
    assert runs[0] == runs[1]
    versions = runs[0]["a"][0][0][4]
    assert versions[0] == 0 and versions[-1] == 1


def test_abort_with_an_update_keeps_the_in_flight_tokens(qwen3_dir):
    """update_weights(abort=True) mid-run: the aborted outputs hold the same tokens as without overlap
    (the step in flight is collected and its token reported, never left as a placeholder)."""
    runs = []
    for engine in engines(qwen3_dir):
        Deferred(engine.runner)
        update = noisy_head(engine, seed=4)
        engine.add_request("a", PROMPTS[2], GREEDY)
        engine.add_request("b", PROMPTS[0], GREEDY)
        for _ in range(5):
            engine.step()
        engine.update_weights_from_tensor(update, abort=True)
        outs = sorted(engine.step(), key=lambda o: o.request_id)
        runs.append(outputs(outs))
        assert all(t >= 0 for o in outs for c in o.outputs for t in c.token_ids)
    assert runs[0] == runs[1] and runs[0][0][0][1] == "abort"
