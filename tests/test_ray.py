"""Rollout engines as Ray actors on a local CPU cluster: the actor's API is the engine's, a group's
outputs equal one engine's, one broadcast reaches every actor, a killed actor is named and the others
keep serving, and the Ray GRPO example learns."""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from test_rl_parts import load_example  # noqa: E402
from weights_helpers import CPU, assert_runs_model, assert_weights_equal, perturbed  # noqa: E402

from integrations.ray import EngineActor, RolloutGroup  # noqa: E402
from rollout import Engine, SamplingParams  # noqa: E402
from rollout.api import ENGINE_METHODS, ENGINE_PROPERTIES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = dict(max_total_tokens=1024, **CPU)
PROMPTS = [[5, 6, 7, 8], [12, 13, 14], [20] * 6, [30, 31], [3], [40, 41, 42]]


@pytest.fixture(scope="module")
def cluster():
    # actors import this checkout, whatever the installed package points at
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def group(cluster, checkpoints):
    with RolloutGroup(2, checkpoints["qwen3"], num_cpus=0.5, **OPTIONS) as g:
        yield g


class OneActor:
    """One actor seen as an engine, for the weight checks of weights_helpers."""

    def __init__(self, actor):
        self.actor = actor

    def get_weights_by_name(self, name, truncate_size=None):
        return ray.get(self.actor.get_weights_by_name.remote(name, truncate_size))

    def generate(self, *args, **kwargs):
        return ray.get(self.actor.generate.remote(*args, **kwargs))


def kill_and_wait(actor, timeout: float = 60.0) -> None:
    """ray.kill, then wait until the actor answers as dead: the kill is asynchronous, and a call made
    at once may still be served (CI saw a ping succeed right after it)."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(actor.info.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the actor still answers {timeout:.0f} s after ray.kill")


def completions(outs):
    """Everything but the logprobs, which a batch of another shape changes by float rounding."""
    return [
        (o.prompt_token_ids, o.prompt, [(c.token_ids, c.text, c.finish_reason) for c in o.outputs])
        for o in outs
    ]


def assert_same_outputs(got, want, tol: float = 1e-5) -> None:
    assert completions(got) == completions(want)
    for g, w in zip(got, want):
        for a, b in zip(g.outputs, w.outputs):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < tol


def seeded(count: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(n=3, seed=100 + j, max_new_tokens=6, logprobs=True, **kw) for j in range(count)]


def params(fn) -> list[inspect.Parameter]:
    # Ray adds a keyword `_ray_trace_ctx` to every actor method it wraps
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "_ray_trace_ctx"]


def test_actor_methods_are_the_engine_api(group):
    for name in ENGINE_METHODS:
        assert params(getattr(EngineActor, name)) == params(getattr(Engine, name)), name
        assert hasattr(group.actors[0], name), name
    for name in ENGINE_PROPERTIES:
        assert len(group.get(name)) == 2, name
    assert [info["device"] for info in group.infos] == ["cpu", "cpu"]
    with pytest.raises(AttributeError, match="not a property"):
        ray.get(group.actors[0].get.remote("_lock"))
    with pytest.raises(TypeError):  # Ray checks calls against Engine's signature
        group.actors[0].flush_cache.remote("unexpected")


def test_generate_splits_and_equals_one_engine(group, checkpoints):
    local = Engine(checkpoints["qwen3"], **OPTIONS)
    before = [s.steps for s in group.get("stats")]
    params = seeded(len(PROMPTS))
    outs = group.generate(input_ids=PROMPTS, sampling_params=params)
    assert_same_outputs(outs, local.generate(input_ids=PROMPTS, sampling_params=params))
    assert all(s.steps > b for s, b in zip(group.get("stats"), before))  # both engines took a share
    # text prompts, one shared greedy SamplingParams, and an odd count
    greedy = SamplingParams(temperature=0, max_new_tokens=5, logprobs=True)
    texts = ["7:", "ab", "1+2="]
    want = local.generate(texts, greedy, use_tqdm=False)
    assert_same_outputs(group.generate(texts, greedy), want)
    assert_same_outputs(group.generate("7:", greedy), want[:1])
    with pytest.raises(ValueError, match="exactly one of"):
        group.generate()
    with pytest.raises(ValueError, match="2 entries for 6 prompts"):
        group.generate(input_ids=PROMPTS, sampling_params=params[:2])
    with pytest.raises(ValueError, match="vocabulary"):  # the engine's own check, raised with its type
        group.generate(input_ids=[[1, 2], [10**6]])


def test_sync_weights_reaches_every_actor(group, checkpoints):
    trainer = perturbed(checkpoints["qwen3"], seed=41)
    versions = group.get("weight_version")
    stats = group.sync_weights(trainer, bucket_bytes=60_000)
    assert stats.transport == "broadcast" and stats.buckets > 1
    assert group.get("weight_version") == [v + stats.buckets for v in versions]
    name = group._sender.group_name
    for actor in group.actors:
        assert_weights_equal(OneActor(actor), trainer)
        assert_runs_model(OneActor(actor), trainer)
    # a second sync reuses the group; after a release, the staged refresh works over the group too
    other = perturbed(checkpoints["qwen3"], seed=42)
    group.release()
    assert all(tags for tags in group.get("released_tags"))
    with pytest.raises(RuntimeError):
        group.generate(input_ids=PROMPTS[:1])
    group.resume(["weights"])
    group.sync_weights(other)
    group.resume()
    assert group._sender.group_name == name
    for actor in group.actors:
        assert_runs_model(OneActor(actor), other)


def test_killed_actor_is_named_and_the_others_serve(cluster, checkpoints):
    local = Engine(checkpoints["qwen2"], **OPTIONS)
    params = seeded(len(PROMPTS))
    with RolloutGroup(2, checkpoints["qwen2"], num_cpus=0.5, **OPTIONS) as g:
        g.sync_weights(perturbed(checkpoints["qwen2"], seed=0))  # a group with both members
        trainer = perturbed(checkpoints["qwen2"], seed=43)
        local.update_weights_from_tensor([(n, p.detach()) for n, p in trainer.named_parameters()])
        kill_and_wait(g.actors[1])
        with pytest.raises(RuntimeError, match=r"(?s)rollout actor 1 of 2 died: .*EngineActor"):
            g.generate(input_ids=PROMPTS, sampling_params=params)
        assert g.alive == [0] and g.remove_dead() == []
        g.sync_weights(trainer)  # a new group of the survivors: world size 2
        assert_weights_equal(OneActor(g.actors[0]), trainer)
        outs = g.generate(input_ids=PROMPTS, sampling_params=params)
        assert_same_outputs(outs, local.generate(input_ids=PROMPTS, sampling_params=params))
        kill_and_wait(g.actors[0])
        assert g.remove_dead() == [0]
        with pytest.raises(RuntimeError, match="all 2 rollout actors died"):
            g.generate(input_ids=PROMPTS)


@pytest.mark.slow
def test_ray_grpo_example_learns(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_CACHE", str(tmp_path))  # the built-in tiny model, made here
    ex = load_example("ray_grpo")
    cfg = ex.Config(steps=30, batch=8, n=8, minibatches=1, seed=0, progress=False)
    history = ex.train(cfg)
    assert [h["step"] for h in history] == list(range(cfg.steps))
    first = sum(h["reward/mean"] for h in history[:3]) / 3
    last = sum(h["reward/mean"] for h in history[-5:]) / 5  # one step's reward swings by up to 0.6
    # seeds 0-4 on a 2-core CPU: the first three steps average 0.01-0.06, the last five 0.48-0.77
    assert last > first + 0.3, [round(h["reward/mean"], 3) for h in history]
    assert max(h["logprob_gap/max"] for h in history) < 1e-4  # float32 engines and trainer
    assert all(h["sync/gb"] > 0 and "time/sync" in h for h in history)


def test_ray_grpo_dry_run_parses_and_shrinks():
    ex = load_example("ray_grpo")
    cfg = ex.parse_args(["--dry-run", "--num-gpus-per-actor", "0.25", "--trainer-gpus", "0.5"]).effective()
    assert (cfg.steps, cfg.batch, cfg.n, cfg.actors) == (2, 4, 4, 2)
    assert cfg.backend == "gloo" and cfg.mem_fraction < 0.3  # everything shares one GPU
    two = ex.parse_args(["--num-gpus-per-actor", "1", "--trainer-gpus", "1", "--actors", "1"]).effective()
    assert two.backend is None and two.mem_fraction == 0.85  # nccl chosen between the GPUs
