"""sync_weights from wrapped trainers in a 2-rank gloo job: DDP, accelerate, FSDP2 (+ activation
checkpointing). Rank 0 owns an in-process engine; rank 1 passes engine=None and only joins the FSDP2
gathers. Rank 0 checks the engine runs the trainer's model."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import torch

from rollout.weights.broadcast import free_port

WORLD = 2


def worker(rank: int, port: int, path: str, results) -> None:
    try:
        results.put((rank, _worker(rank, port, path)))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _worker(rank: int, port: int, path: str) -> str:
    import torch.distributed as dist
    from weights_helpers import CPU, assert_runs_model, assert_weights_equal, perturbed

    from integrations import hf_named_parameters, sync_weights
    from rollout import Engine

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD)
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    engine = Engine(path, max_total_tokens=1024, **CPU) if rank == 0 else None
    names = [n for n, _ in hf_named_parameters(perturbed(path, 0))]

    # DDP
    ddp_model = perturbed(path, seed=41)
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    assert [n for n, _ in hf_named_parameters(ddp)] == names
    sync_weights(ddp, engine, bucket_bytes=50_000)
    if engine:
        assert_runs_model(engine, ddp_model)

    # accelerate (wraps in DDP on a multi-process CPU job)
    from accelerate import Accelerator

    acc_model = perturbed(path, seed=42)
    prepared = Accelerator(cpu=True).prepare(acc_model)
    assert isinstance(prepared, torch.nn.parallel.DistributedDataParallel), type(prepared)
    sync_weights(prepared, engine, bucket_bytes=50_000)
    if engine:
        assert_runs_model(engine, acc_model)

    # FSDP2, the first layer also wrapped for activation checkpointing
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    reference, sharded = perturbed(path, seed=43), perturbed(path, seed=43)
    mesh = init_device_mesh("cpu", (WORLD,))
    sharded.model.layers[0] = checkpoint_wrapper(sharded.model.layers[0])
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    assert type(next(sharded.parameters())).__name__ == "DTensor"
    assert [n for n, _ in hf_named_parameters(sharded)] == names
    stats = sync_weights(sharded, engine, bucket_bytes=30_000)
    if engine:
        assert stats.buckets > 3
        assert_weights_equal(engine, reference)
        assert_runs_model(engine, reference)
    dist.destroy_process_group()
    return "ok"


def test_ddp_accelerate_fsdp2(checkpoints):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, checkpoints["qwen3"], results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        outcome = dict(results.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert outcome == {0: "ok", 1: "ok"}, "\n".join(str(v) for v in outcome.values())
