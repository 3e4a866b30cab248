"""Copy plans (rollout/weights/plan.py): updates through a cached plan load the same bits as a fresh
validation would, a bucket in the engine's storage order is one byte copy, a changed signature gets a
new plan, and a refused update leaves the weights intact also when its signature has a plan."""

from __future__ import annotations

import pytest
import torch
from weights_helpers import (
    CPU,
    FUSED_NAMES,
    all_names,
    assert_same_snapshot,
    assert_weights_equal,
    load_hf,
    perturbed,
    snapshot,
    state_list,
)

from integrations import sync_weights, weight_sync
from integrations.weight_sync import in_order
from rollout import Engine
from rollout.weights.bucket import pack
from rollout.weights.loader import PARAM_ALIGN, refuse_nonfinite

FAMILIES = ["qwen2", "qwen3"]  # untied with qkv bias; tied with q/k norms


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def make_engine(path: str, **kw) -> Engine:
    return Engine(path, max_total_tokens=256, **{**CPU, **kw})


def test_parameters_are_views_of_one_storage(checkpoints, family):
    engine = make_engine(checkpoints[family])
    storage = engine.model.weight_storage
    start, end = storage.data_ptr(), storage.data_ptr() + storage.numel()
    params = list(engine.model.parameters())
    for p in params:
        assert start <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= end
        assert (p.data_ptr() - start) % PARAM_ALIGN == 0
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in params)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # no overlap
    if family == "qwen3":  # tied: one parameter for both names
        assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight


@pytest.mark.parametrize("how", ["list", "bucket", "bucket in storage order"])
def test_repeated_updates_equal_the_trainer_bit_for_bit(checkpoints, family, how):
    """Through a cached plan (the second and third update) the weights equal the trainer's, fused q/k/v
    and gate/up slices and tied embeddings included."""
    engine = make_engine(checkpoints[family])
    plans = engine.weights.plans
    for seed in (1, 2, 3):
        trainer = perturbed(checkpoints[family], seed=seed)
        named = state_list(trainer)
        if how == "list":
            engine.update_weights_from_tensor(named)
        else:
            if how == "bucket in storage order":
                named = in_order(named, engine.weight_order)
            engine.update_weights_from_tensor(pack(named), load_format="flattened_bucket")
        assert_weights_equal(engine, trainer, all_names(trainer) + FUSED_NAMES)
    assert (plans.misses, plans.hits, len(plans)) == (1, 2, 1)


def test_a_bucket_in_storage_order_is_one_copy(checkpoints, family):
    engine = make_engine(checkpoints[family])
    named = in_order(state_list(load_hf(checkpoints[family])), engine.weight_order)
    prepared = engine.weights.unpack(pack(named), "flattened_bucket")
    assert prepared.plan.runs is not None and len(prepared.plan.runs) == 1
    prepared = engine.weights.unpack(pack(named[::-1]), "flattened_bucket")  # reversed: one run each
    assert len(prepared.plan.runs) == len(named)
    cast = engine.weights.unpack(pack(named, dtype=torch.bfloat16), "flattened_bucket")
    assert cast.plan.runs is None  # not the engine's bytes: copied through views, casting


def test_a_changed_signature_gets_its_own_plan(checkpoints):
    engine = make_engine(checkpoints["qwen2"])
    trainer = perturbed(checkpoints["qwen2"], seed=4)
    named = state_list(trainer)
    plans = engine.weights.plans
    engine.update_weights_from_tensor(named)
    engine.update_weights_from_tensor(named[:5])  # fewer names
    engine.update_weights_from_tensor(named[::-1])  # another order
    engine.update_weights_from_tensor([(n, t.to(torch.bfloat16)) for n, t in named])  # other dtypes
    assert (plans.misses, len(plans)) == (4, 4)
    for name, t in named:  # the last update's values, rounded to bfloat16
        assert torch.equal(engine.get_weights_by_name(name), t.to(torch.bfloat16).float()), name
    engine.update_weights_from_tensor(named)
    assert plans.hits == 1
    assert_weights_equal(engine, trainer)
    # a shape the model does not take is refused whether or not its name has a plan
    name, t = named[0]
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights_from_tensor([(name, t[:-1])])


@pytest.mark.parametrize("how", ["list", "bucket", "bucket in storage order"])
@pytest.mark.parametrize("fault", ["nan", "inf", "overflow", "shape", "name", "dtype"])
def test_a_refused_update_with_a_cached_plan_writes_nothing(checkpoints, how, fault):
    """The plan of the good update is cached first; the bad one differs in a value (same signature:
    it hits the plan) or in its signature (a new plan, whose validation refuses it)."""
    engine = make_engine(checkpoints["qwen2"], dtype="float16")
    named = state_list(perturbed(checkpoints["qwen2"], seed=5))
    if how == "bucket in storage order":
        named = in_order(named, engine.weight_order)

    def send(pairs):
        if how == "list":
            return engine.update_weights_from_tensor(pairs)
        return engine.update_weights_from_tensor(pack(pairs), load_format="flattened_bucket")

    send(named)
    before, version = snapshot(engine, load_hf(checkpoints["qwen2"])), engine.weight_version
    bad = list(named)
    i = len(bad) // 2
    name, t = bad[i]
    if fault == "nan":
        t = t.clone()
        t.view(-1)[3] = float("nan")
    elif fault == "inf":
        t = t.clone()
        t.view(-1)[3] = float("-inf")
    elif fault == "overflow":  # finite in float32, inf once loaded as the engine's float16
        t = t.clone()
        t.view(-1)[3] = 1e6
    elif fault == "shape":
        t = t[..., :-1]
    elif fault == "name":
        name = name.replace("layers", "layerz")
    else:
        t = t.to(torch.int32)
    bad[i] = (name, t)
    errors = (ValueError, TypeError)
    with pytest.raises(errors, match="NaN or inf" if fault in ("nan", "inf", "overflow") else ""):
        send(bad)
    assert engine.weight_version == version
    assert_same_snapshot(engine, before)


def test_refuse_nonfinite_checks_the_destination_dtype():
    big = [("w", torch.tensor([1.0, 7e4]))]
    refuse_nonfinite(big)  # finite as float32
    refuse_nonfinite(big, [torch.bfloat16])  # and as bfloat16 (float32's range)
    with pytest.raises(ValueError, match="'w'"):
        refuse_nonfinite(big, [torch.float16])  # float16 tops out at 65504
    refuse_nonfinite([("w", torch.tensor([65519.0]))], [torch.float16])  # rounds down to 65504


@pytest.mark.parametrize("flatten", [False, True])
def test_sync_weights_through_plans_keeps_buffers(checkpoints, family, flatten):
    engine = make_engine(checkpoints[family])
    for seed in (6, 7):
        trainer = perturbed(checkpoints[family], seed=seed)
        stats = sync_weights(trainer, engine, bucket_bytes=40_000, flatten=flatten, keep_buffers=True)
        assert stats.buckets > 1
        assert_weights_equal(engine, trainer, all_names(trainer) + FUSED_NAMES)
    plans = engine.weights.plans
    assert plans.hits == plans.misses == stats.buckets  # the second sync reused every plan
    if flatten:
        runs = [p.runs for p in plans._plans.values()]
        assert all(r is not None and len(r) == 1 for r in runs)  # storage order: one copy a bucket
        assert weight_sync._KEPT[engine] != [None]  # the flattened pack buffer is kept for the next sync
    weight_sync.release_sync_buffers(engine)
    assert engine not in weight_sync._KEPT
