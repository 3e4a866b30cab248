"""Engines inside a 2-rank world (gloo on the CPU): tensor parallel equals one rank, data parallel splits a
batch, weight loading takes full tensors, bad settings and failing ranks raise instead of hanging."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
import torch
from dist_cluster import Cluster
from helpers import PROMPTS
from safetensors.torch import load_file

from integrations.torchrun import Layout, TorchrunEnv
from rollout import Engine, SamplingParams
from rollout.distributed import CollectiveError
from rollout.models.toy import build_checkpoint
from rollout.weights.loader import WeightTarget, load_tensors

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=3)
SAMPLED = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, ignore_eos=True, logprobs=True, seed=7)
ENGINE = dict(page_size=4, max_total_tokens=1024)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(2, tmp_path_factory.mktemp("dist"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def ckpts(checkpoints, tmp_path_factory) -> dict[str, str]:
    """Qwen3 (qk-norm) and Qwen2 (qkv bias), each tied and untied, plus checkpoints that cannot split."""
    root = tmp_path_factory.mktemp("tp-ckpt")
    extra = {
        "qwen3-untied": dict(arch="qwen3", seed=5),
        "qwen2-tied": dict(arch="qwen2", seed=6, tie_word_embeddings=True),
        "qwen3-heads3": dict(arch="qwen3", seed=7, num_attention_heads=3, num_key_value_heads=1, head_dim=16),
        "qwen3-other": dict(arch="qwen3", seed=8, tie_word_embeddings=True),  # weights for an update
    }
    made = {name: str(build_checkpoint(root / name, **kw)) for name, kw in extra.items()}
    return {"qwen3-tied": checkpoints["qwen3"], "qwen2-untied": checkpoints["qwen2"], **made, **checkpoints}


def summary(outs) -> list[tuple[list[int], list[float], list[dict[int, float]] | None]]:
    return [(c.token_ids, c.logprobs, c.top_logprobs) for r in outs for c in r.outputs]


def run_params(engine: Engine, prompts=PROMPTS):
    return summary(engine.generate(input_ids=prompts, sampling_params=GREEDY)) + summary(
        engine.generate(input_ids=prompts, sampling_params=SAMPLED)
    )


def assert_same(ours, ref, atol=2e-5):
    assert len(ours) == len(ref)
    for (tokens, lps, top), (ref_tokens, ref_lps, ref_top) in zip(ours, ref):
        assert tokens == ref_tokens
        torch.testing.assert_close(lps, ref_lps, atol=atol, rtol=0)
        if ref_top is not None:
            for a, b in zip(top, ref_top):
                assert list(a) == list(b)
                torch.testing.assert_close(list(a.values()), list(b.values()), atol=atol, rtol=0)


# -- on every rank (module-level so the workers can import them) -----------------------------------------
def rank_tp_generate(path: str, update: str | None = None, source: str | None = None):
    """tp_size=2 outputs; `update` first loads the weights of checkpoint `source`: through the loader,
    the engine's update_weights_from_tensor, or integrations.sync_weights from a transformers model."""
    engine = Engine(path, tp_size=2, **ENGINE)
    assert engine.tp.size == 2 and engine.config.tp_size == 2
    if update in ("loader", "engine"):
        named = list(load_file(f"{source}/model.safetensors").items())
        if update == "loader":
            load_tensors(engine.model, named)
            engine.flush_cache()
            read = lambda name: WeightTarget(name, *engine.model.resolve(name)).read()
        else:
            assert engine.update_weights_from_tensor(named) == len(named)
            read = engine.get_weights_by_name
        for name, full in named:  # reads gather the shards back into the full tensor
            assert torch.equal(read(name), full), name
    elif update == "sync_weights":
        from transformers import AutoModelForCausalLM

        from integrations import sync_weights

        sync_weights(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), engine)
        assert engine.weight_version == 1
    return run_params(engine)


def rank_given_groups(path: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    by_mesh = Engine(path, tp_group=mesh["tp"], **ENGINE)
    by_group = Engine(path, tp_group=dist.new_group([0, 1], backend="gloo"), **ENGINE)
    assert by_mesh.config.tp_size == by_group.config.tp_size == 2
    return run_params(by_mesh), run_params(by_group)


def rank_data_parallel(path: str, prompts: list[list[int]]):
    import torch.distributed as dist

    from integrations.torchrun import DataParallelRollout

    engine = Engine(path, **ENGINE)
    dp = DataParallelRollout(engine, seed=5)
    seeded = [replace(SAMPLED, seed=i) for i in range(len(prompts))]
    everyone = summary(dp.generate(input_ids=prompts, sampling_params=GREEDY))
    to_rank0 = dp.generate(input_ids=prompts, sampling_params=seeded, dst=0)
    unseeded = replace(SAMPLED, seed=None)
    local = dp.generate(
        input_ids=prompts if dist.get_rank() == 0 else None, sampling_params=unseeded, src=0, dst=None
    )
    errors = []
    rank = dist.get_rank()
    for ids in ([[5, 6]] if rank == 0 else "not token ids", [[5, 6 + rank]]):  # bad on rank 1; differ
        try:
            dp.generate(input_ids=ids, sampling_params=GREEDY)
            errors.append(None)
        except (TypeError, ValueError, RuntimeError) as e:
            errors.append((type(e).__name__, str(e)))
    return dict(
        errors=errors,
        groups=dp.layout.groups,
        share=list(dp.layout.share(len(prompts))),
        everyone=everyone,
        to_rank0=None if to_rank0 is None else summary(to_rank0),
        local_prompts=[r.prompt_token_ids for r in local],
        local=summary(local),
    )


def rank_bad_settings(paths: dict[str, str]):
    errors = []
    for path, options in [
        (paths["qwen3-tied"], dict(tp_size=3)),
        (paths["mistral"], dict(tp_size=2)),
        (paths["qwen3-heads3"], dict(tp_size=2)),
        (paths["qwen3-tied"], dict(tp_group="ranks 0 and 1")),
    ]:
        try:
            Engine(path, **options, **ENGINE)
            errors.append(None)
        except (ValueError, TypeError) as e:
            errors.append((type(e).__name__, str(e)))
    return errors


def rank_inputs_disagree(path: str):
    import torch.distributed as dist

    rank = dist.get_rank()
    engine = Engine(path, tp_size=2, tp_timeout=30, **ENGINE)
    errors = []
    for ids in ([[5 + rank, 6, 7]], [[5, 6, 500 if rank == 1 else 7]]):  # different; bad on rank 1 only
        try:
            engine.generate(input_ids=ids, sampling_params=GREEDY)
            errors.append(None)
        except (ValueError, RuntimeError) as e:
            errors.append((type(e).__name__, str(e)))
    after = engine.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)[0].outputs[0].token_ids
    return errors, after


def rank_release_resume(path: str):
    import torch.distributed as dist

    engine = Engine(path, tp_size=2, tp_timeout=30, **ENGINE)
    before = run_params(engine)
    engine.release_memory_occupation(keep_weights_backup=True)  # every rank releases and resumes
    engine.resume_memory_occupation()
    after = run_params(engine)
    if dist.get_rank() == 1:  # one rank alone released: the group refuses to generate, on both ranks
        engine.release_memory_occupation(tags="kv_cache")
    errors = []
    for _ in range(2):
        try:
            engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            errors.append(None)
        except (RuntimeError, ValueError) as e:
            errors.append(str(e))
        engine.resume_memory_occupation()  # rank 1's prefix cache is empty now, rank 0's is not
    engine.flush_cache()  # on every rank: equal states again
    return before == after, errors, run_params(engine) == before


def rank_one_raises(path: str, timeout: float):
    import torch.distributed as dist

    engine = Engine(path, tp_size=2, tp_timeout=timeout, **ENGINE)
    if dist.get_rank() == 1:
        real, calls = engine.runner.launch, []

        def failing_step(batch, prev=None):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected fault on rank 1")
            return real(batch, prev)

        engine.runner.launch = failing_step
    t0 = time.monotonic()
    try:
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        error = None
    except Exception as e:
        error = (type(e).__name__, str(e))
    waited = time.monotonic() - t0
    dist.barrier()  # rank 1 waits on the default group while rank 0 times out on the engine's group
    return error, waited


# -- tests -------------------------------------------------------------------------------------------------
FAMILIES = ["qwen3-tied", "qwen3-untied", "qwen2-untied", "qwen2-tied"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_matches_one_rank(family, cluster, ckpts):
    ref = run_params(Engine(ckpts[family], **ENGINE))
    rank0, rank1 = cluster.values(rank_tp_generate, ckpts[family])
    assert rank0 == rank1  # every rank of the group gets the same outputs
    assert_same(rank0, ref)


@pytest.mark.parametrize("update", ["loader", "engine", "sync_weights"])
def test_weight_update_on_tp2_matches_one_rank(update, cluster, ckpts):
    ref = run_params(Engine(ckpts["qwen3-other"], **ENGINE))
    before = run_params(Engine(ckpts["qwen3-tied"], **ENGINE))
    assert [t for t, _, _ in ref] != [t for t, _, _ in before]  # the update changes the outputs
    rank0, rank1 = cluster.values(rank_tp_generate, ckpts["qwen3-tied"], update, ckpts["qwen3-other"])
    assert rank0 == rank1
    assert_same(rank0, ref)


def test_given_group_or_mesh(cluster, ckpts):
    ref = run_params(Engine(ckpts["qwen3-tied"], **ENGINE))
    for by_mesh, by_group in cluster.values(rank_given_groups, ckpts["qwen3-tied"]):
        assert_same(by_mesh, ref)
        assert_same(by_group, ref)


def test_data_parallel_ranks_serve_their_share(cluster, ckpts):
    engine = Engine(ckpts["qwen3-tied"], **ENGINE)
    seeded = [replace(SAMPLED, seed=i) for i in range(len(PROMPTS))]
    rng = random.Random(5)  # the seeds DataParallelRollout(seed=5) gives unseeded requests, call by call
    [rng.getrandbits(63) for _ in PROMPTS]  # first call: greedy, unseeded
    drawn = [replace(SAMPLED, seed=rng.getrandbits(63)) for _ in PROMPTS]  # third call
    single_greedy = summary(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    single_seeded = summary(engine.generate(input_ids=PROMPTS, sampling_params=seeded))
    single_drawn = engine.generate(input_ids=PROMPTS, sampling_params=drawn)

    rank0, rank1 = cluster.values(rank_data_parallel, ckpts["qwen3-tied"], PROMPTS)
    assert rank0["groups"] == ((0,), (1,))
    assert rank0["share"] == [0, 1, 2] and rank1["share"] == [3, 4]  # 5 prompts: 3 + 2
    for r in (rank0, rank1):
        assert_same(r["everyone"], single_greedy)
        assert r["local_prompts"] == [PROMPTS[i] for i in r["share"]]
        assert_same(r["local"], summary([single_drawn[i] for i in r["share"]]))
    assert_same(rank0["to_rank0"], single_seeded)
    assert rank1["to_rank0"] is None
    (bad0, differ0), (bad1, differ1) = rank0["errors"], rank1["errors"]
    assert bad1 == ("TypeError", "input_ids must be a list of token ids or a list of such lists")
    assert bad0 == ("RuntimeError", f"generate inputs failed on rank(s) [1]; rank 1: TypeError: {bad1[1]}")
    assert differ0 == differ1 and differ0[0] == "ValueError" and "different global batch" in differ0[1]


def test_layout_splits_and_checks():
    layout = Layout.from_reports([(0, 1), (0, 1), (2, 3), (2, 3)], rank=2)
    assert layout.groups == ((0, 1), (2, 3)) and layout.index == 1 and layout.leader(1) == 2
    assert [list(layout.share(5, i)) for i in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(layout.share(1, i)) for i in range(2)] == [[0], []]
    with pytest.raises(ValueError, match="do not partition the world"):
        Layout.from_reports([(0, 1), (1,)], rank=0)
    with pytest.raises(ValueError, match="RANK=None: launch with torchrun"):
        TorchrunEnv.from_env({})
    assert TorchrunEnv.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).local_rank == 1


def test_bad_tp_settings_raise_on_every_rank(cluster, ckpts):
    for errors in cluster.values(rank_bad_settings, ckpts, timeout=60):
        world, kv_heads, heads, group = errors
        assert world == ("ValueError", "tp_size=3 does not divide the world size 2 of torch.distributed")
        assert kv_heads == ("ValueError", "tp_size=2 does not divide num_key_value_heads=1")
        assert heads == ("ValueError", "tp_size=2 does not divide num_attention_heads=3")
        assert group[0] == "TypeError" and "tp_group must be a ProcessGroup" in group[1]


def test_tp_needs_torch_distributed(qwen3_dir):
    with pytest.raises(ValueError, match="tp_size=2 needs torch.distributed initialised"):
        Engine(qwen3_dir, tp_size=2, **ENGINE)
    with pytest.raises(ValueError, match="tp_timeout must be a positive number"):
        Engine(qwen3_dir, tp_timeout=0, **ENGINE)


def test_ranks_with_different_inputs_all_raise(cluster, ckpts):
    (errors0, after0), (errors1, after1) = cluster.values(rank_inputs_disagree, ckpts["qwen3-tied"])
    differ0, bad0 = errors0
    differ1, bad1 = errors1
    assert differ0 == differ1 and differ0[0] == "ValueError"
    assert differ0[1].startswith("generate inputs: the inputs differ between the ranks")
    assert bad1[0] == "ValueError" and "outside the vocabulary" in bad1[1]  # rank 1's own error
    assert bad0 == ("RuntimeError", "generate inputs raised on tensor-parallel rank(s) [1] of group [0, 1]")
    assert after0 == after1 and len(after0) == GREEDY.max_new_tokens  # the engines stay usable


def test_release_resume_on_every_rank(cluster, ckpts):
    (same0, errors0, again0), (same1, errors1, again1) = cluster.values(
        rank_release_resume, ckpts["qwen3-tied"]
    )
    assert same0 and same1 and again0 and again1
    assert errors1[0].startswith("cannot generate: the engine's memory is released (kv_cache)")
    assert errors0[0] == "generate inputs raised on tensor-parallel rank(s) [1] of group [0, 1]"
    assert errors0[1] == errors1[1]
    assert errors0[1].startswith("generate inputs: the engine_state differ between the ranks")


def test_a_failing_rank_makes_the_other_fail(cluster, ckpts):
    (error0, waited0), (error1, _) = cluster.values(rank_one_raises, ckpts["qwen3-tied"], 2.0)
    assert error1 == ("RuntimeError", "injected fault on rank 1")
    assert error0[0] == CollectiveError.__name__
    assert "another rank of the group raised, exited or made different calls" in error0[1]
    assert "2s timeout" in error0[1]
    assert waited0 < 30


def rank_example(*argv: str):
    import importlib.util
    import os
    from pathlib import Path

    import torch.distributed as dist

    rank = dist.get_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    path = Path(__file__).parents[1] / "examples" / "torchrun_rl.py"
    spec = importlib.util.spec_from_file_location("torchrun_rl", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main(["--steps", "1", "--max-new-tokens", "8", *argv])


def test_torchrun_example_syncs_weights(cluster):
    """examples/torchrun_rl.py on 2 ranks with tp_size=2: after a training step and a weight sync, the
    engine's logprobs are the trained model's (without the sync they differ by about 5e-2)."""
    gaps0, _ = cluster.values(rank_example, "--tp-size", "2")
    assert len(gaps0) == 2 and max(gaps0) < 1e-4


# -- GPUs ----------------------------------------------------------------------------------------------------
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="tensor parallelism across ranks needs 2 CUDA devices"
)


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    c = Cluster(2, tmp_path_factory.mktemp("nccl"), backend="nccl")
    yield c
    c.close()


def rank_gpu_generate(path: str, dtype: str, tp_size: int):
    import torch.distributed as dist

    from integrations.torchrun import DataParallelRollout

    engine = Engine(path, tp_size=tp_size, dtype=dtype, device=f"cuda:{dist.get_rank()}", **ENGINE)
    if tp_size == 2:
        return run_params(engine)
    dp = DataParallelRollout(engine)
    return summary(dp.generate(input_ids=PROMPTS, sampling_params=GREEDY)) + summary(
        dp.generate(input_ids=PROMPTS, sampling_params=replace(SAMPLED, seed=None))
    )


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_tp2_matches_one_gpu(dtype, gpu_cluster, ckpts):
    ref = run_params(Engine(ckpts["qwen3-untied"], dtype=dtype, device="cuda:0", **ENGINE))
    rank0, rank1 = gpu_cluster.values(rank_gpu_generate, ckpts["qwen3-untied"], dtype, 2, timeout=300)
    assert rank0 == rank1  # both ranks sampled the same tokens
    if dtype == "float32":
        assert_same(rank0, ref, atol=1e-3)
    else:  # bfloat16 sums in another order over two GPUs: most greedy tokens still agree
        same = sum(a[0] == b[0] for a, b in zip(rank0, ref))
        assert same >= len(ref) // 2, f"{same} of {len(ref)} samples agree"


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_data_parallel_engines(gpu_cluster, ckpts):
    rank0, rank1 = gpu_cluster.values(rank_gpu_generate, ckpts["qwen3-untied"], "float32", 1, timeout=300)
    assert rank0 == rank1
    ref = summary(
        Engine(ckpts["qwen3-untied"], dtype="float32", device="cuda:0", **ENGINE).generate(
            input_ids=PROMPTS, sampling_params=GREEDY
        )
    )
    assert_same(rank0[: len(ref)], ref, atol=1e-3)


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_torchrun_example(gpu_cluster):
    """FSDP2 training and nccl tensor parallelism in one job; float32 engine so the sync is exact."""
    gaps0, _ = gpu_cluster.values(rank_example, "--tp-size", "2", "--dtype", "float32", timeout=300)
    assert max(gaps0) < 1e-3
