"""weights_checksum and integrations.verify_sync: exact integer checksums, equal on both sides of every
transport after a sync, and a planted one-element corruption caught and named."""

from __future__ import annotations

import pytest
import torch
from weights_helpers import CPU, perturbed

from integrations import BroadcastSender, WeightMismatchError, sync_weights, verify_sync
from integrations.verify import trainer_checksums
from rollout import Engine
from rollout.process import EngineProcess
from rollout.weights import checksum as cs

MASK = (1 << 64) - 1
K_NAME = "model.layers.1.self_attn.k_proj.weight"


def reference(t: torch.Tensor, chunk: int) -> int:
    """The checksum's definition in plain Python integers (no wraparound to trust)."""
    bits = cs._bits(t).tolist()
    w = [v & MASK for v in cs._weights(t.device)[:chunk].tolist()]
    total = 0
    for start in range(0, len(bits), chunk):
        piece = bits[start : start + chunk]
        total = (total + sum(b * wi for b, wi in zip(piece, w))) * (cs._K1 & MASK) & MASK
    return (total + len(bits)) & MASK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_checksum_is_its_integer_definition(monkeypatch, dtype):
    monkeypatch.setattr(cs, "CHUNK", 64)  # several chunks, a partial last one
    monkeypatch.setattr(cs, "_WEIGHTS", {})
    t = (torch.randn(7, 29) * 1e3).to(dtype)
    assert cs.checksum(t) == reference(t, 64)
    assert cs.checksum(t.clone()) == cs.checksum(t) == cs.checksum(t.t().contiguous().t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_single_element_change_is_seen(monkeypatch, dtype):
    monkeypatch.setattr(cs, "CHUNK", 128)
    monkeypatch.setattr(cs, "_WEIGHTS", {})
    t = torch.randn(300).to(dtype)
    base, seen = cs.checksum(t), set()
    for i in range(t.numel()):
        for flip in (1, 1 << (t.element_size() * 8 - 1)):  # lowest mantissa bit, sign bit
            u = t.clone()
            u.view(cs._BITS[t.element_size()])[i] ^= flip
            seen.add(cs.checksum(u))
    assert base not in seen and len(seen) == 2 * t.numel()  # and no two changes collide here
    assert cs.checksum(t.reshape(3, 100)) == base  # a shape-agnostic bit count...
    assert cs.checksum(t[:-1]) != base  # ...but not length-agnostic


def corrupt(engine, name: str = K_NAME) -> None:
    """Change one element of the engine's fused qkv parameter, inside the k slice, in place."""
    qkv = engine.model.model.layers[1].self_attn.qkv_proj
    k_row = qkv.local_sizes[0] + 3
    row = qkv.weight.data[k_row]
    row.view(cs._BITS[row.element_size()])[5] ^= 1  # the lowest mantissa bit: the smallest change


def one_element_update(model, name: str = K_NAME) -> list[tuple[str, torch.Tensor]]:
    t = model.get_parameter(name).detach().clone()
    t.view(-1)[17] += 0.5  # survives a cast to bfloat16
    return [(name, t)]


def test_engine_checksums_are_hf_views(checkpoints):
    path = checkpoints["qwen3"]
    engine = Engine(path, max_total_tokens=256, **CPU)
    names = [K_NAME, "model.embed_tokens.weight", "lm_head.weight"]
    got = engine.weights_checksum(names)
    assert got == {n: cs.checksum(engine.get_weights_by_name(n)) for n in names}
    every = engine.weights_checksum()
    assert set(every) == set(engine.model.hf_names()) and every[K_NAME] == got[K_NAME]
    with pytest.raises(ValueError, match="unknown weight name 'model.nope.weight'"):
        engine.weights_checksum(["model.nope.weight"])
    with pytest.raises(TypeError, match="names"):
        engine.weights_checksum(K_NAME)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_in_process_catches_a_planted_corruption(checkpoints, dtype):
    path = checkpoints["qwen3"]
    engine = Engine(path, max_total_tokens=256, dtype=dtype, **CPU)
    trainer = perturbed(path, seed=21)
    with pytest.raises(WeightMismatchError, match="model.embed_tokens.weight"):  # before any sync
        verify_sync(trainer, engine)
    sync_weights(trainer, engine, bucket_bytes=50_000, verify=True)  # float32 crosses as the engine's dtype
    corrupt(engine)
    with pytest.raises(WeightMismatchError, match=K_NAME) as err:
        verify_sync(trainer, engine)
    assert err.value.name == K_NAME
    sync_weights(trainer, engine, verify=True)  # a fresh sync repairs it
    assert verify_sync(trainer, engine) == len(list(trainer.parameters()))


def test_verify_over_engine_process_and_gloo_broadcast(checkpoints):
    path = checkpoints["qwen3"]
    trainer = perturbed(path, seed=22)
    with EngineProcess(path, max_total_tokens=256, **CPU) as proc:
        sync_weights(trainer, proc, bucket_bytes=60_000, verify=True)
        proc.update_weights_from_tensor(one_element_update(trainer))
        with pytest.raises(WeightMismatchError, match=K_NAME):
            verify_sync(trainer, proc)
        other = perturbed(path, seed=23)
        with BroadcastSender.for_engine(proc, backend="gloo", group_name="verify", timeout=60) as sender:
            sync_weights(other, sender, bucket_bytes=60_000, verify=True)
            proc.update_weights_from_tensor(one_element_update(other, "model.norm.weight"))
            with pytest.raises(WeightMismatchError, match="model.norm.weight"):
                verify_sync(other, sender)
        with pytest.raises(WeightMismatchError):
            verify_sync(trainer, proc)


def test_sender_without_on_checksum_and_engine_none(checkpoints):
    trainer = perturbed(checkpoints["qwen3"], seed=24)
    sender = BroadcastSender.__new__(BroadcastSender)
    sender.on_checksum = None
    with pytest.raises(ValueError, match="on_checksum"):
        verify_sync(trainer, sender, dtype=None)
    assert verify_sync(trainer, None) == len(list(trainer.parameters()))  # gathers only
    assert trainer_checksums(trainer) == trainer_checksums(perturbed(checkpoints["qwen3"], seed=24))


@pytest.mark.gpu
def test_checksum_on_device_equals_the_cpu(checkpoints):
    path = checkpoints["qwen3"]
    engine = Engine(path, max_total_tokens=256, page_size=4, device="cuda", dtype="bfloat16")
    trainer = perturbed(path, seed=25).cuda()
    sync_weights(trainer, engine, verify=True)
    on_device = engine.weights_checksum()
    assert on_device == {n: cs.checksum(engine.get_weights_by_name(n)) for n in on_device}  # CPU copies
    engine.update_weights_from_tensor(one_element_update(trainer))  # crosses as float32, lands bf16
    with pytest.raises(WeightMismatchError, match=K_NAME):
        verify_sync(trainer, engine)
