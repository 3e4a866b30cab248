"""SGLang's surface beyond the RL flows of test_compat_sglang.py, called as SGLang's own tests and the
frameworks call it: every ServerArgs / SamplingParams / generate() name (honoured, neutral, or refused
by name as unsupported), load_format="direct" with the engine's fused names, custom_weight_loader,
get_weights_checksum, the memory-state errors, malformed bucket metadata, the serialisation helpers and
the default update group."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import re
import traceback

import pytest
import torch
from helpers import PROMPTS
from test_weights_broadcast import TIMEOUT, sglang_style_group
from weights_helpers import (
    assert_same_snapshot,
    assert_weights_equal,
    load_hf,
    perturbed,
    snapshot,
    state_list,
)

from rollout.compat.sglang import (
    Engine,
    LocalSerializedTensor,
    MultiprocessingSerializer,
    deserialize_tensors,
    serialize_tensors,
)
from rollout.weights.broadcast import free_port

ARGS = dict(device="cpu", page_size=4, max_total_tokens=1024, random_seed=0)
GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
LOADER = "test_compat_sglang_surface.copy_by_param_name"
QKV = "model.layers.0.self_attn.qkv_proj.weight"


def copy_by_param_name(model, named_tensors):
    """A custom_weight_loader as SGLang's test writes one: copy into the named parameters."""
    params = dict(model.named_parameters())
    for name, t in named_tensors:
        params[name].data.copy_(t)


@pytest.fixture(scope="module")
def front(qwen3_dir):
    # neutral values of ServerArgs the engine has no use for, as verl / slime / OpenRLHF pass them
    with Engine(
        qwen3_dir,
        dp_size=1,
        ep_size=1,
        pp_size=1,
        base_gpu_id=0,
        gpu_id_step=1,
        cuda_graph_max_bs_decode=8,
        custom_weight_loader=[LOADER],
        skip_tokenizer_init=True,
        trust_remote_code=True,
        load_format="auto",
        port=30000,
        nnodes=1,
        node_rank=0,
        enable_metrics=False,
        **ARGS,
    ) as e:
        yield e


def test_server_args_neutral_accepted_others_refused_by_name(front, qwen3_dir):
    assert front.engine.config.cuda_graph_max_bs == 8  # cuda_graph_max_bs_decode is honoured
    for name, value in [("dp_size", 2), ("ep_size", 4), ("speculative_algorithm", "EAGLE"), ("pp_size", 2)]:
        with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} unsupported")):
            Engine(qwen3_dir, **{name: value}, **ARGS)
    with pytest.raises(ValueError, match="load_format='gguf' unsupported"):
        Engine(qwen3_dir, load_format="gguf", **ARGS)
    with pytest.raises(TypeError, match="unknown server args"):
        Engine(qwen3_dir, dp_sizes=1, **ARGS)


def test_every_sampling_key_accepted_unsupported_ones_refused_by_name(front):
    base = front.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
    # verl's async_generate sends these; top_k=1 << 30 is SGLang's "whole vocabulary"
    same = {
        **GREEDY,
        "spaces_between_special_tokens": False,
        "top_k": 1 << 30,
        "stream_interval": 1,
        "json_schema": None,
        "regex": None,
        "ebnf": None,
        "custom_params": None,
        "stop_regex": None,
        "structural_tag": None,
        "sampling_seed": None,
    }
    assert front.generate(input_ids=PROMPTS[0], sampling_params=same)["output_ids"] == base
    # a temperature under SGLang's 1e-6 samples greedily
    tiny_t = {**GREEDY, "temperature": 1e-7}
    assert front.generate(input_ids=PROMPTS[0], sampling_params=tiny_t)["output_ids"] == base
    for key, value in [
        ("json_schema", "{}"),
        ("regex", "a+"),
        ("ebnf", "root ::= 'a'"),
        ("stream_interval", 4),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"{key}={value!r} unsupported")):
            front.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, key: value})
    out = front.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert out["output_ids"] == base  # the engine stays usable


def test_generate_arguments_neutral_accepted(front):
    base = front.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
    out = front.generate(
        input_ids=PROMPTS[0],
        sampling_params=GREEDY,
        image_data=None,
        return_hidden_states=False,
        custom_logit_processor=None,
        data_parallel_rank=None,
        rid=None,
        priority=None,
    )
    assert out["output_ids"] == base
    with pytest.raises(ValueError, match="return_hidden_states=True unsupported"):
        front.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, return_hidden_states=True)


def test_direct_load_takes_the_engines_fused_names(front, qwen3_dir):
    model = perturbed(qwen3_dir, seed=81)
    attn = model.model.layers[0].self_attn
    fused = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
    try:
        ok, msg = front.update_weights_from_tensor([(QKV, fused)], load_format="direct")
        assert ok, msg
        for part in ("q_proj", "k_proj", "v_proj"):
            name = f"model.layers.0.self_attn.{part}.weight"
            got = torch.tensor(front.get_weights_by_name(name, truncate_size=10**6))
            assert torch.equal(got, getattr(attn, part).weight.detach())
        before = snapshot(front.engine, load_hf(qwen3_dir))
        for bad, needle in [
            ([("model.layers.0.self_attn.q_proj.weight", fused)], "not a parameter of the engine"),
            ([(QKV, fused[:-1])], "shape"),
            ([(QKV, fused), ("model.norm.weight", torch.full((64,), float("nan")))], "NaN"),
        ]:
            ok, msg = front.update_weights_from_tensor(bad, load_format="direct")
            assert not ok and needle in msg, msg
            assert_same_snapshot(front.engine, before)  # all or nothing
    finally:
        assert front.update_weights_from_disk(qwen3_dir)[0]


def test_custom_weight_loader_is_called_with_the_model(front, qwen3_dir):
    norm = "model.norm.weight"
    new = torch.linspace(0.5, 1.5, 64)
    try:
        ok, msg = front.update_weights_from_tensor([(norm, new)], load_format=LOADER)
        assert ok, msg
        assert torch.equal(torch.tensor(front.get_weights_by_name(norm)), new)
        ok, msg = front.update_weights_from_tensor([(norm, new)], load_format="tests.not_listed")
        assert not ok and "custom_weight_loader" in msg, msg
    finally:
        assert front.update_weights_from_disk(qwen3_dir)[0]


def test_get_weights_checksum_is_sglangs_sha256_over_the_stored_weights(front, qwen3_dir):
    first = front.get_weights_checksum()
    assert isinstance(first, str) and len(first) == 64 and int(first, 16) >= 0
    h = hashlib.sha256()  # SGLang's: names sorted, each name then its tensor's raw bytes
    for name, p in sorted(front.engine.model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    assert first == h.hexdigest()
    assert any("qkv_proj" in n for n, _ in front.engine.stored_weights())  # as stored: fused
    norm = torch.tensor(front.get_weights_by_name("model.norm.weight"))
    bumped = norm.clone()
    bumped[3] = torch.nextafter(bumped[3], torch.tensor(2.0))  # one element, one ulp
    try:
        assert front.update_weights_from_tensor([("model.norm.weight", bumped)])[0]
        assert front.get_weights_checksum() != first
        assert front.update_weights_from_tensor([("model.norm.weight", norm)])[0]
        assert front.get_weights_checksum() == first
    finally:
        assert front.update_weights_from_disk(qwen3_dir)[0]


def test_release_twice_and_resume_unreleased_raise_runtime_error(front):
    with pytest.raises(RuntimeError, match="not released"):
        front.resume_memory_occupation(["weights"])
    ok, msg = front.release_memory_occupation(["kv_cache"])
    assert ok and "kv_cache" in msg, msg
    with pytest.raises(RuntimeError, match="already released"):
        front.release_memory_occupation(["kv_cache"])
    assert front.resume_memory_occupation(["kv_cache"])[0]
    with pytest.raises(RuntimeError, match="not released"):
        front.resume_memory_occupation()
    assert front.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 5


@pytest.mark.parametrize("metadata", [[5], "abc", [None]])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_malformed_bucket_metadata_answers_false(front, qwen3_dir, metadata, dtype):
    before = snapshot(front.engine, load_hf(qwen3_dir))
    bucket = {"flattened_tensor": torch.zeros(64, dtype=dtype), "metadata": metadata}
    ok, msg = front.update_weights_from_tensor(bucket, load_format="flattened_bucket")
    assert ok is False and "metadata" in msg, msg
    assert_same_snapshot(front.engine, before)


def test_serialisation_helpers_import_from_the_front():
    named = [("a", torch.arange(4.0)), ("b", torch.ones(2, 2))]
    for output_str in (False, True):
        back = deserialize_tensors(serialize_tensors(named, output_str=output_str))
        assert [n for n, _ in back] == ["a", "b"] and all(
            torch.equal(x, y) for (_, x), (_, y) in zip(back, named)
        )
    local = LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(torch.arange(3))])
    assert torch.equal(local.get(0), torch.arange(3))


# -- OpenRLHF's SGLang actor: a named group, then update_weights_from_distributed(name, dtype, shape) --
def openrlhf_trainer(port: int, group: str, named: list, errors) -> None:
    try:
        import torch.distributed as dist

        pg = sglang_style_group(port, 2, group)
        for _, t in named:
            dist.broadcast(t.contiguous(), 0, pg)
        dist.destroy_process_group(pg)
    except BaseException:
        errors.put(traceback.format_exc())
        raise


@pytest.mark.slow
def test_single_group_is_the_default(front, qwen3_dir):
    model = perturbed(qwen3_dir, seed=82)
    named = state_list(model)
    port = free_port()
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    trainer = ctx.Process(target=openrlhf_trainer, args=(port, "openrlhf", named, errors))
    trainer.start()
    try:
        ok, msg = front.init_weights_update_group("127.0.0.1", port, 1, 2, "openrlhf", backend="gloo")
        assert ok, msg
        for name, t in named:
            ok, msg = front.update_weights_from_distributed(name, t.dtype, list(t.shape))
            assert ok, msg
        assert_weights_equal(front.engine, model)
        assert front.destroy_weights_update_group()[0]
        trainer.join(TIMEOUT)
    finally:
        if trainer.is_alive():
            trainer.kill()
        front.update_weights_from_disk(qwen3_dir)
    assert errors.empty() and trainer.exitcode == 0, errors.get() if not errors.empty() else trainer.exitcode
