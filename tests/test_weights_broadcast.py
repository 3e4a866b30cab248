"""Broadcast groups (gloo on the CPU): a trainer in a spawned process, the engine in this one.

The trainer first joins the way trainers written for SGLang do (`init_custom_process_group`: torch's
rendezvous, a store prefixed by the group name, `_new_process_group_helper`), then with our
BroadcastSender as under torchrun (elastic agent store in the environment, a default group in place).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
from weights_helpers import (
    CPU,
    assert_runs_model,
    assert_same_snapshot,
    assert_weights_equal,
    perturbed,
    snapshot,
)

from integrations.weight_sync import BroadcastSender, hf_named_parameters, plan_buckets, sync_weights
from rollout import Engine
from rollout.weights.broadcast import free_port

TIMEOUT = 120


def sglang_style_group(port: int, world_size: int, group_name: str):
    """What OpenRLHF / slime / AReaL trainers run on their side (written here from that pattern)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=TIMEOUT)
    store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend("gloo"),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def trainer_main(ports: dict, rounds: list, sync_state: dict, bucket_bytes: int, errors) -> None:
    try:
        _trainer(ports, rounds, sync_state, bucket_bytes)
    except BaseException:
        errors.put(traceback.format_exc())
        raise


def _trainer(ports, rounds, sync_state, bucket_bytes) -> None:
    import torch.distributed as dist

    # a torchrun-like default group of its own, which must stay untouched
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports['default']}", rank=0, world_size=1)
    pg = sglang_style_group(ports["sglang"], 2, "sglang-group")
    for fmt, named in rounds:
        if fmt == "flattened_bucket":
            flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in named])
            dist.broadcast(flat, src=0, group=pg)
        else:
            for _, t in named:
                dist.broadcast(t.contiguous(), src=0, group=pg)
    dist.destroy_process_group(pg)

    # our sender, as under torchrun: TORCHELASTIC_USE_AGENT_STORE would make torch's rendezvous
    # wait for an agent store no one hosts here
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sync_state["path"]))
    model.load_state_dict(sync_state["state"], strict=False)
    model.tie_weights()
    with BroadcastSender("127.0.0.1", ports["sender"], 2, "sender-group", "gloo", timeout=TIMEOUT) as sender:
        sync_weights(model, sender, bucket_bytes=bucket_bytes)
    assert dist.get_world_size() == 1 and dist.get_rank() == 0  # default group untouched
    x = torch.ones(2)
    dist.all_reduce(x)
    assert x.tolist() == [1.0, 1.0]
    dist.destroy_process_group()


def specs(named):
    return (
        [n for n, _ in named],
        [str(t.dtype).removeprefix("torch.") for _, t in named],
        [list(t.shape) for _, t in named],
    )


def test_sglang_style_trainer_and_broadcast_sender(checkpoints):
    path = checkpoints["qwen3"]
    engine = Engine(path, max_total_tokens=1024, **CPU)
    m1, m2, m3 = (perturbed(path, seed=s) for s in (31, 32, 33))
    named1 = [(n, p.detach()) for n, p in m1.named_parameters()]
    named2 = [(n, p.detach()) for n, p in m2.named_parameters()]
    norm = named2[-1][1]
    unknown = [("model.norm.weight", norm), ("model.layers.0.mlp.bogus.weight", norm)]
    misshapen = [("model.norm.weight", torch.ones(3))]
    rounds = [(None, named1), ("flattened_bucket", named2), ("flattened_bucket", unknown), (None, misshapen)]
    bucket_bytes = 60_000
    ports = {"default": free_port(), "sglang": free_port(), "sender": free_port()}
    sync_state = {"path": path, "state": {k: v.clone() for k, v in m3.state_dict().items()}}

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    trainer = ctx.Process(target=trainer_main, args=(ports, rounds, sync_state, bucket_bytes, errors))
    trainer.start()
    try:
        engine.init_weights_update_group(
            "127.0.0.1", ports["sglang"], 1, 2, "sglang-group", "gloo", timeout=TIMEOUT
        )
        engine.update_weights_from_distributed(*specs(named1), "sglang-group")
        assert_weights_equal(engine, m1)
        assert_runs_model(engine, m1)
        engine.update_weights_from_distributed(*specs(named2), "sglang-group", load_format="flattened_bucket")
        assert_runs_model(engine, m2)
        before = snapshot(engine, m2)
        with pytest.raises(ValueError, match="unknown weight name"):
            engine.update_weights_from_distributed(*specs(unknown), "sglang-group", "flattened_bucket")
        with pytest.raises(ValueError, match="shape"):
            engine.update_weights_from_distributed(*specs(misshapen), "sglang-group")
        assert_same_snapshot(engine, before)
        assert engine.weight_version == 2
        engine.destroy_weights_update_group("sglang-group")
        with pytest.raises(ValueError, match="no weights update group"):
            engine.update_weights_from_distributed(*specs(named1), "sglang-group")

        # the BroadcastSender side: the engine receives each bucket sync_weights will send
        engine.init_weights_update_group(
            "127.0.0.1", ports["sender"], 1, 2, "sender-group", "gloo", timeout=TIMEOUT
        )
        for b in plan_buckets(hf_named_parameters(m3), bucket_bytes, None):
            names = [m.name for m in b.metas]
            engine.update_weights_from_distributed(
                names,
                [m.dtype for m in b.metas],
                [m.shape for m in b.metas],
                "sender-group",
                "flattened_bucket",
            )
        engine.destroy_weights_update_group("sender-group")
        assert_weights_equal(engine, m3)
        assert_runs_model(engine, m3)
        trainer.join(TIMEOUT)
    finally:
        if trainer.is_alive():
            trainer.kill()
    assert errors.empty() and trainer.exitcode == 0, errors.get() if not errors.empty() else trainer.exitcode


def test_engine_side_times_out_when_the_trainer_never_comes(checkpoints):
    engine = Engine(checkpoints["qwen3"], max_total_tokens=256, **CPU)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"weights update group 'lonely' \(rank 1 of 2.*1.5s"):
        engine.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "lonely", "gloo", timeout=1.5)
    assert time.perf_counter() - t0 < 15
    with pytest.raises(ValueError, match="no weights update group"):
        engine.destroy_weights_update_group("lonely")


def test_sender_side_times_out_when_the_engine_never_comes():
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="did not all join within 1.5s"):
        BroadcastSender("127.0.0.1", free_port(), 3, "lonely-sender", "gloo", timeout=1.5)
    assert time.perf_counter() - t0 < 15
    with pytest.raises(ValueError, match="world_size"):
        BroadcastSender("127.0.0.1", free_port(), 1, "alone", "gloo", timeout=1.5)


def test_cpu_engine_cannot_join_an_nccl_group(checkpoints):
    engine = Engine(checkpoints["qwen3"], max_total_tokens=256, **CPU)
    with pytest.raises(ValueError, match="nccl"):
        engine.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "n", backend="nccl")
    assert torch.distributed.is_available()
