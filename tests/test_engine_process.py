"""EngineProcess: the engine in a child process, weights crossing by shared memory (CUDA IPC on a GPU)
and by a gloo broadcast group; errors re-raised in the parent; clean shutdown."""

from __future__ import annotations

import operator
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from weights_helpers import (
    CPU,
    FUSED_NAMES,
    assert_runs_model,
    assert_same_snapshot,
    assert_weights_equal,
    load_hf,
    outputs,
    perturbed,
    snapshot,
    state_list,
)

from integrations import BroadcastSender, sync_weights
from rollout import Engine
from rollout.process import KILL_GRACE_S, EngineProcess, RemoteTraceback
from rollout.weights.bucket import empty_buffer, pack

OPTIONS = dict(max_total_tokens=1024, **CPU)
GPU = dict(max_total_tokens=1024, page_size=4)


@pytest.fixture(scope="module")
def proc(checkpoints):
    with EngineProcess(checkpoints["qwen3"], **OPTIONS) as p:
        yield p


def test_generates_like_an_in_process_engine(proc, checkpoints):
    local = Engine(checkpoints["qwen3"], **OPTIONS)
    assert proc.info["device"] == "cpu"
    assert proc.weight_order == local.weight_order and set(proc.weight_order) == set(local.model.hf_names())
    assert (proc.pool_tokens, proc.max_model_len) == (local.pool_tokens, local.max_model_len)
    assert outputs(proc) == outputs(local)
    assert_weights_equal(proc, load_hf(checkpoints["qwen3"]), FUSED_NAMES)


def test_list_and_bucket_updates_over_shared_memory(proc, checkpoints):
    version = proc.weight_version
    trainer = perturbed(checkpoints["qwen3"], seed=11)
    assert proc.update_weights_from_tensor(state_list(trainer)) > 0
    assert_weights_equal(proc, trainer)
    assert_runs_model(proc, trainer)
    other = perturbed(checkpoints["qwen3"], seed=12)
    named = state_list(other)
    buffer = empty_buffer(sum(t.numel() * 4 for _, t in named), shared=True)
    proc.update_weights_from_tensor(pack(named, out=buffer), load_format="flattened_bucket")
    assert proc.weight_version == version + 2
    assert_weights_equal(proc, other)
    assert_runs_model(proc, other)


def test_sync_weights_double_buffered(proc, checkpoints):
    version = proc.weight_version
    trainer = perturbed(checkpoints["qwen3"], seed=13)
    stats = sync_weights(trainer, proc, bucket_bytes=30_000)
    assert stats.transport == "ipc" and stats.buckets >= 4  # both buffers reused twice or more
    assert proc.weight_version == version + stats.buckets
    assert_weights_equal(proc, trainer)
    assert_runs_model(proc, trainer)


def test_child_errors_reraised_with_type_and_weights_intact(proc, checkpoints):
    model = load_hf(checkpoints["qwen3"])
    before, version = snapshot(proc, model), proc.weight_version
    good = state_list(perturbed(checkpoints["qwen3"], seed=14))
    with pytest.raises(ValueError, match="unknown weight name 'model.layers.0.mlp.bogus.weight'") as err:
        proc.update_weights_from_tensor([*good, ("model.layers.0.mlp.bogus.weight", good[0][1])])
    assert isinstance(err.value.__cause__, RemoteTraceback) and "loader.py" in str(err.value.__cause__)
    with pytest.raises(TypeError, match="floating-point"):
        proc.update_weights_from_tensor([*good[:-1], (good[-1][0], good[-1][1].long())])
    with pytest.raises(ValueError, match="no weights update group"):
        proc.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "missing")
    with pytest.raises(AttributeError):
        proc.call("no_such_method")
    with pytest.raises(AttributeError, match="not part of the API"):
        proc.call("_apply_update", good, False)
    assert proc.weight_version == version
    assert_same_snapshot(proc, before)


def test_gloo_broadcast_to_engine_process(proc, checkpoints):
    trainer = perturbed(checkpoints["qwen3"], seed=15)
    with BroadcastSender.for_engine(proc, backend="gloo", group_name="w-test", timeout=60) as sender:
        stats = sync_weights(trainer, sender, bucket_bytes=50_000)
        assert stats.transport == "broadcast" and stats.buckets > 1
        assert_weights_equal(proc, trainer)
        assert_runs_model(proc, trainer)
        # one tensor per broadcast, SGLang's default format
        other = perturbed(checkpoints["qwen3"], seed=16)
        sender.send_tensors(state_list(other))
        assert_runs_model(proc, other)
        # a rejected set is received in full (the group stays in step) and then refused
        before = snapshot(proc, other)
        with pytest.raises(ValueError, match="unknown weight name"):
            sender.send_tensors(
                [("model.norm.weight", torch.ones(64)), ("model.bogus.weight", torch.ones(2))]
            )
        assert_same_snapshot(proc, before)
    with pytest.raises(ValueError, match="no weights update group named 'w-test'"):
        proc.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "w-test")


def test_start_up_error_reraised(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        EngineProcess(str(tmp_path / "missing"))


def test_close_and_child_death(checkpoints):
    p = EngineProcess(checkpoints["qwen2"], **OPTIONS)
    pending = p.submit("get_weights_by_name", "model.norm.weight")
    p.close()  # answers the pending call first
    assert pending.result().shape == (64,)
    assert not p.alive and p.exitcode == 0
    p.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        p.flush_cache()
    with EngineProcess(checkpoints["qwen2"], **OPTIONS) as q:
        os.kill(q.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="died"):
            q.weight_version  # noqa: B018
    assert not q.alive


# -- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_ipc_sync_matches_in_process_engine(checkpoints):
    """One GPU: buckets cross by CUDA IPC. The child engine must equal an in-process engine given the
    same weights directly, bit for bit, and the sender's buffers must be freed afterwards."""
    path = checkpoints["qwen3"]
    trainer = perturbed(path, seed=21).to("cuda", torch.bfloat16)
    local = Engine(path, **GPU, device="cuda")
    local.update_weights_from_tensor(state_list(trainer))
    with EngineProcess(path, **GPU, device="cuda") as p:
        assert p.info["dtype"] == str(local.dtype)
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        stats = sync_weights(trainer, p, bucket_bytes=30_000)
        assert stats.transport == "ipc" and stats.buckets >= 4
        assert torch.cuda.memory_allocated() == baseline  # double buffers released (ipc_collect)
        assert_weights_equal(p, trainer)
        assert_weights_equal(p, trainer, FUSED_NAMES)
        assert outputs(p) == outputs(local)
        p.update_weights_from_tensor(state_list(perturbed(path, seed=22).to("cuda", torch.bfloat16)))
        assert outputs(p) != outputs(local)


@pytest.mark.gpu
def test_nccl_broadcast_between_two_gpus(checkpoints):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL broadcast needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    path = checkpoints["qwen3"]
    trainer = perturbed(path, seed=23).to("cuda:0", torch.bfloat16)
    local = Engine(path, **GPU, device="cuda:1")
    local.update_weights_from_tensor(state_list(trainer))
    with EngineProcess(path, **GPU, device="cuda:1") as p:
        with BroadcastSender.for_engine(p, backend="nccl", device="cuda:0", timeout=120) as sender:
            stats = sync_weights(trainer, sender, bucket_bytes=50_000)
            assert stats.transport == "broadcast" and stats.buckets > 1
            assert_weights_equal(p, trainer)
            assert outputs(p) == outputs(local)


# -- faults ------------------------------------------------------------------------------------------
class _FailsToUnpickle:
    """Pickles fine here; rebuilding it in the child raises (as a class the child cannot import would)."""

    def __reduce__(self):
        return operator.truediv, (1, 0)


def test_arguments_that_fail_to_unpickle_fail_that_call_only(proc):
    version = proc.weight_version
    with pytest.raises(ZeroDivisionError):
        proc.get_weights_by_name(_FailsToUnpickle())
    assert proc.alive and proc.weight_version == version  # the child still serves
    assert proc.get_weights_by_name("model.norm.weight").shape == (64,)


def test_close_escalates_on_an_unresponsive_child(checkpoints):
    p = EngineProcess(checkpoints["qwen2"], **OPTIONS)
    os.kill(p.pid, signal.SIGSTOP)  # alive but answering nothing
    t0 = time.monotonic()
    p.close(timeout=1.0)
    elapsed = time.monotonic() - t0
    assert not p.alive and p.exitcode is not None  # reaped (killed)
    assert elapsed < 1.0 + 2 * KILL_GRACE_S + 1.0


FD_SCRIPT = """
import os, resource, sys, torch
from rollout import EngineProcess
from rollout.weights.loader import iter_checkpoint, safetensors_files
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
named = [(n, t.clone()) for n, t in iter_checkpoint(safetensors_files(sys.argv[1]))]
assert len(named) > 128, len(named)
with EngineProcess(sys.argv[1], device="cpu", max_total_tokens=256) as p:
    assert p.update_weights_from_tensor(named) == len(named)  # starts multiprocessing's fd sharer
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        assert p.update_weights_from_tensor(named) == len(named)
    after = len(os.listdir("/proc/self/fd"))
print("fds", before, after)
assert after <= before, (before, after)
"""


def test_long_tensor_lists_cross_at_a_low_fd_limit(tmp_path):
    from rollout.models.toy import build_checkpoint

    path = build_checkpoint(tmp_path / "deep", num_hidden_layers=16, tokenizer=False)  # ~180 tensors
    proc = subprocess.run(
        [sys.executable, "-c", FD_SCRIPT, str(path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_child_serves_with_its_start_up_heap_frozen(checkpoints):
    """serve_child freezes what building the engine made before it serves (no full collection walks
    the model's objects under load), and unfreezes once the loop ends, so they are finalised at exit."""
    import gc
    from multiprocessing import Pipe

    from rollout.process import serve_child

    seen = []
    parent, child = Pipe()
    assert gc.get_freeze_count() == 0
    serve_child(child, checkpoints["qwen3"], OPTIONS, lambda conn, engine: seen.append(gc.get_freeze_count()))
    assert parent.recv().ok and seen[0] > 10_000
    assert gc.get_freeze_count() == 0
