"""Weight updates into an in-process Engine: lists, flattened buckets, disk, sync_weights; bad updates
are rejected with the old weights intact."""

from __future__ import annotations

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

from integrations import hf_named_parameters, sync_weights
from rollout import Engine, SamplingParams
from rollout.models.toy import build_checkpoint
from rollout.weights.bucket import FlattenedBucket, TensorMeta, pack

FAMILIES = ["qwen2", "qwen3"]  # untied with qkv bias; tied with q/k norms


def make_engine(path: str) -> Engine:
    return Engine(path, max_total_tokens=1024, **CPU)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def test_list_update_runs_trainer_model(checkpoints, family):
    engine = make_engine(checkpoints[family])
    trainer = perturbed(checkpoints[family], seed=1)
    before = outputs(engine)
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    assert engine.update_weights_from_tensor(state_list(trainer)) == len(state_list(trainer))
    assert engine.weight_version == 1
    assert_weights_equal(engine, trainer)
    assert_weights_equal(engine, trainer, FUSED_NAMES)
    assert_runs_model(engine, trainer)
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == ptrs  # copied in place
    assert outputs(engine) != before  # the perturbation is visible in the outputs


def test_flattened_bucket_update_and_dtype_cast(checkpoints, family):
    engine = make_engine(checkpoints[family])
    trainer = perturbed(checkpoints[family], seed=2)
    named = state_list(trainer)
    half = len(named) // 2
    for part in (named[:half], named[half:]):  # two buckets, as a trainer sends them
        engine.update_weights_from_tensor(pack(part), load_format="flattened_bucket")
    assert engine.weight_version == 2
    assert_weights_equal(engine, trainer)
    assert_runs_model(engine, trainer)
    # float64 in, float32 parameters: the engine casts
    other = perturbed(checkpoints[family], seed=3)
    engine.update_weights_from_tensor(pack(state_list(other, torch.float64)), load_format="flattened_bucket")
    assert_runs_model(engine, other)


def test_sglang_bucket_dict_accepted(checkpoints):
    engine = make_engine(checkpoints["qwen3"])
    trainer = perturbed(checkpoints["qwen3"], seed=4)
    b = pack(state_list(trainer))
    meta = [
        dict(
            name=m.name, dtype=m.dtype, shape=list(m.shape), start_idx=m.offset, end_idx=m.end, numel=m.numel
        )
        for m in b.metas
    ]
    engine.update_weights_from_tensor({"flattened_tensor": b.buffer, "metadata": meta}, "flattened_bucket")
    assert_weights_equal(engine, trainer)


def test_partial_update_and_prefix_cache_flush(checkpoints):
    engine = make_engine(checkpoints["qwen3"])
    trainer = load_hf(checkpoints["qwen3"])
    engine.generate(input_ids=[list(range(5, 30))], sampling_params=SamplingParams(max_new_tokens=2))
    assert engine.pages.index  # the prompt's pages are cached
    with torch.no_grad():
        trainer.model.norm.weight.mul_(1.5)
        trainer.model.layers[1].self_attn.k_proj.weight.mul_(-1)
    engine.update_weights_from_tensor(
        [
            ("model.norm.weight", trainer.model.norm.weight),
            ("model.layers.1.self_attn.k_proj.weight", trainer.model.layers[1].self_attn.k_proj.weight),
        ]
    )
    assert not engine.pages.index  # stale KV is never reused
    assert_weights_equal(engine, trainer)
    assert_runs_model(engine, trainer)


def test_get_weights_by_name(checkpoints, hf_models):
    engine = make_engine(checkpoints["llama"])  # tied embeddings, fused q/k/v and gate/up
    model = hf_models["llama"]
    assert_weights_equal(engine, model, FUSED_NAMES)
    head = engine.get_weights_by_name("lm_head.weight", truncate_size=3)
    assert torch.equal(head, model.lm_head.weight[:3])
    assert head.device.type == "cpu"
    head.zero_()  # a copy: the engine's weights are not touched
    assert_weights_equal(engine, model, ["lm_head.weight"])
    with pytest.raises(ValueError, match="unknown weight name"):
        engine.get_weights_by_name("model.layers.0.self_attn.qkv_proj.weight")
    with pytest.raises(ValueError, match="truncate_size"):
        engine.get_weights_by_name("lm_head.weight", truncate_size=-1)


# -- rejected updates leave the weights intact ------------------------------------------------------
def _bad_bucket(kind: str, named):
    b = pack(named)
    m0, m1 = b.metas[0], b.metas[1]
    if kind == "offset past end":
        return FlattenedBucket(
            b.buffer, [*b.metas[:-1], TensorMeta(b.metas[-1].name, m0.dtype, (4, 4), b.nbytes)]
        )
    if kind == "overlap":
        return FlattenedBucket(
            b.buffer, [m0, TensorMeta(m1.name, m1.dtype, m1.shape, m0.offset + 4), *b.metas[2:]]
        )
    if kind == "negative offset":
        return FlattenedBucket(b.buffer, [TensorMeta(m0.name, m0.dtype, m0.shape, -4), *b.metas[1:]])
    if kind == "not bytes":
        return FlattenedBucket(b.buffer.view(torch.float32), b.metas)
    if kind == "no entries":
        return FlattenedBucket(b.buffer, [])
    if kind == "sglang end_idx":
        meta = [
            dict(name=m.name, dtype=m.dtype, shape=m.shape, start_idx=m.offset, end_idx=m.end + 1)
            for m in b.metas
        ]
        return {"flattened_tensor": b.buffer, "metadata": meta}
    if kind == "not a bucket":
        return named
    raise AssertionError(kind)


BAD_BUCKETS = [
    "offset past end",
    "overlap",
    "negative offset",
    "not bytes",
    "no entries",
    "sglang end_idx",
    "not a bucket",
]


def _bad_list(kind: str, named, engine):
    norm = engine.get_weights_by_name("model.norm.weight")
    bad = {
        "unknown name": [("model.layers.0.mlp.bogus.weight", norm)],
        "name without dots": [("bogus", norm)],
        "fused name": [("model.layers.0.self_attn.qkv_proj.weight", norm)],
        "layer out of range": [("model.layers.9.mlp.up_proj.weight", norm)],
        "wrong shape": [("model.norm.weight", torch.ones(3))],
        "transposed": [
            (
                "model.layers.0.mlp.down_proj.weight",
                named_dict(named)["model.layers.0.mlp.down_proj.weight"].T,
            )
        ],
        "int dtype": [("model.norm.weight", torch.ones(norm.shape, dtype=torch.int32))],
        "bool dtype": [("model.norm.weight", torch.ones(norm.shape, dtype=torch.bool))],
        "duplicate": [("model.norm.weight", norm), ("model.norm.weight", norm)],
        "not a tensor": [("model.norm.weight", norm.tolist())],
        "not a pair": [("model.norm.weight",)],
        "not a list": "model.norm.weight",
    }[kind]
    return bad if isinstance(bad, str) else named + bad  # valid tensors first: none may be written


def named_dict(named):
    return dict(named)


BAD_LISTS = [
    "unknown name",
    "name without dots",
    "fused name",
    "layer out of range",
    "wrong shape",
    "transposed",
    "int dtype",
    "bool dtype",
    "duplicate",
    "not a tensor",
    "not a pair",
    "not a list",
]


@pytest.fixture(scope="module")
def bad_setup(checkpoints):
    engine = make_engine(checkpoints["qwen3"])
    trainer = perturbed(checkpoints["qwen3"], seed=5)
    model = load_hf(checkpoints["qwen3"])
    return engine, state_list(trainer), snapshot(engine, model), outputs(engine)


def _assert_intact(engine, before, before_out):
    assert engine.weight_version == 0
    assert_same_snapshot(engine, before)
    tokens, logprobs = outputs(engine)
    assert tokens == before_out[0]
    assert max(abs(a - b) for x, y in zip(logprobs, before_out[1]) for a, b in zip(x, y)) < 1e-5


@pytest.mark.parametrize("kind", BAD_LISTS)
def test_bad_list_update_rejected(bad_setup, kind):
    engine, named, before, before_out = bad_setup
    with pytest.raises((ValueError, TypeError)) as err:
        engine.update_weights_from_tensor(_bad_list(kind, named, engine))
    assert "weight" in str(err.value) or "named_tensors" in str(err.value)
    _assert_intact(engine, before, before_out)


@pytest.mark.parametrize("kind", BAD_BUCKETS)
def test_bad_bucket_rejected(bad_setup, kind):
    engine, named, before, before_out = bad_setup
    with pytest.raises((ValueError, TypeError), match="bucket|flattened"):
        engine.update_weights_from_tensor(_bad_bucket(kind, named), load_format="flattened_bucket")
    _assert_intact(engine, before, before_out)


def test_bad_arguments_rejected(bad_setup):
    engine, named, before, before_out = bad_setup
    with pytest.raises(ValueError, match="load_format"):
        engine.update_weights_from_tensor(named, load_format="safetensors")
    with pytest.raises(ValueError, match="no tensors"):
        engine.update_weights_from_tensor([])
    with pytest.raises(ValueError, match="no weights update group named 'nope'"):
        engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "nope")
    with pytest.raises(ValueError, match="no weights update group"):
        engine.destroy_weights_update_group("nope")
    with pytest.raises(ValueError, match="backend"):
        engine.init_weights_update_group("127.0.0.1", 29999, 1, 2, "g", backend="nccl")  # CPU engine
    with pytest.raises(ValueError, match="rank_offset"):
        engine.init_weights_update_group("127.0.0.1", 29999, 0, 2, "g", backend="gloo")
    _assert_intact(engine, before, before_out)


def test_update_refused_while_requests_run(checkpoints):
    engine = make_engine(checkpoints["qwen3"])
    trainer = perturbed(checkpoints["qwen3"], seed=6)
    engine.add_request("r", [5, 6, 7], SamplingParams())
    before = engine.get_weights_by_name("model.norm.weight")
    with pytest.raises(RuntimeError, match="in flight"):
        engine.update_weights_from_tensor(state_list(trainer))
    assert torch.equal(engine.get_weights_by_name("model.norm.weight"), before)
    assert engine.has_unfinished()
    engine.update_weights_from_tensor(state_list(trainer), abort=True)
    assert not engine.has_unfinished()
    (aborted,) = engine.step()
    assert aborted.request_id == "r" and aborted.outputs[0].finish_reason == "abort"
    assert engine.weight_version == 1
    assert_runs_model(engine, trainer)


# -- disk ------------------------------------------------------------------------------------------
def test_update_from_disk(checkpoints, tmp_path):
    engine = make_engine(checkpoints["qwen2"])
    trainer = perturbed(checkpoints["qwen2"], seed=7)
    trainer.save_pretrained(tmp_path / "step1")
    assert engine.update_weights_from_disk(tmp_path / "step1") > 0
    assert engine.weight_version == 1
    assert_runs_model(engine, trainer)
    before = snapshot(engine, trainer)
    wider = build_checkpoint(tmp_path / "wider", "qwen2", tokenizer=False, intermediate_size=96)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights_from_disk(wider)
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        engine.update_weights_from_disk(checkpoints["llama"])
    with pytest.raises(ValueError, match="config.json"):
        engine.update_weights_from_disk(tmp_path / "missing")
    assert engine.weight_version == 1
    assert_same_snapshot(engine, before)


# -- trainer side, in process ----------------------------------------------------------------------
@pytest.mark.parametrize("flatten", [False, True])
def test_sync_weights_in_process(checkpoints, flatten):
    engine = make_engine(checkpoints["qwen3"])
    trainer = perturbed(checkpoints["qwen3"], seed=8)
    stats = sync_weights(trainer, engine, bucket_bytes=40_000, flatten=flatten)
    assert stats.transport == "in-process" and stats.buckets > 3
    assert stats.tensors == len(list(trainer.parameters()))
    assert engine.weight_version == stats.buckets
    assert_weights_equal(engine, trainer)
    assert_runs_model(engine, trainer)


def test_sync_weights_names_through_wrappers(checkpoints):
    trainer = load_hf(checkpoints["qwen3"])
    plain = [n for n, _ in hf_named_parameters(trainer)]
    compiled = torch.compile(trainer)  # wraps as _orig_mod; nothing is compiled until called
    assert [n for n, _ in hf_named_parameters(compiled)] == plain
    assert [n for n, _ in hf_named_parameters(torch.nn.DataParallel(trainer))] == plain
    with pytest.raises(TypeError, match="engine must be"):
        sync_weights(trainer, object())
    with pytest.raises(ValueError, match="bucket_bytes"):
        sync_weights(trainer, None, bucket_bytes=0)


def test_release_resume_then_sync(checkpoints):
    """The loop of DESIGN.md: release, (train), resume weights, push new ones, generate."""
    engine = make_engine(checkpoints["qwen3"])
    trainer = perturbed(checkpoints["qwen3"], seed=9)
    engine.release_memory_occupation()
    with pytest.raises(RuntimeError, match="released"):
        sync_weights(trainer, engine)
    engine.resume_memory_occupation(tags=["weights"])
    named = state_list(trainer)
    engine.update_weights_from_tensor(named[:3])  # a partial update does not make the engine ready
    engine.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
    with pytest.raises(RuntimeError, match="discarded"):
        outputs(engine)
    sync_weights(trainer, engine)
    assert_runs_model(engine, trainer)


@pytest.mark.gpu
def test_update_reaches_captured_decode_graphs(checkpoints, tmp_path):
    """Updates copy into the parameters' storage, so decode graphs captured before still run the new
    model: the updated engine must equal a fresh engine loaded from the new weights."""
    path = checkpoints["qwen3"]
    opts = dict(device="cuda", cuda_graph=True, max_total_tokens=1024, page_size=4)
    engine = Engine(path, **opts)
    before = outputs(engine)  # decode graphs captured and replayed
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    trainer = perturbed(path, seed=10).to("cuda", torch.bfloat16)
    trainer.save_pretrained(tmp_path / "new")
    sync_weights(trainer, engine, bucket_bytes=60_000)
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == ptrs
    after = outputs(engine)
    assert after != before
    assert after == outputs(Engine(str(tmp_path / "new"), **opts))
