"""The SGLang-shaped front, driven as verl, slime and OpenRLHF drive SGLang's offline Engine (the call
sites are written here from those frameworks' patterns). Each checks the engine then holds the
trainer's weights and its greedy outputs equal transformers'."""

from __future__ import annotations

import gc
import multiprocessing as mp
import traceback
from unittest import mock

import pytest
import torch
from helpers import PROMPTS, hf_greedy, hf_logprobs
from test_lora import ATTN, MLP, peft_model
from test_sampling_options import EOS, hf_greedy_adjusted
from test_weights_broadcast import TIMEOUT, sglang_style_group
from weights_helpers import (
    assert_runs_model,
    assert_same_snapshot,
    assert_weights_equal,
    load_hf,
    perturbed,
    snapshot,
    state_list,
)

from rollout import SamplingParams as NativeParams
from rollout.compat.serialize import (
    LocalSerializedTensor,
    MultiprocessingSerializer,
    deserialize_tensors,
    serialize_tensors,
)
from rollout.compat.sglang import Engine
from rollout.weights.broadcast import free_port

ARGS = dict(device="cpu", page_size=4, max_total_tokens=1024, random_seed=0)


@pytest.fixture
def front(qwen3_dir):
    with Engine(qwen3_dir, **ARGS) as e:
        yield e


def test_server_args_translate_and_unknown_names_raise(qwen3_dir):
    e = Engine(
        model_path=qwen3_dir,
        context_length=256,
        disable_radix_cache=True,
        disable_cuda_graph=True,
        max_running_requests=7,
        mem_fraction_static=0.5,
        attention_backend="torch_native",
        **ARGS,
    )
    cfg = e.engine.config
    assert (cfg.max_model_len, cfg.enable_prefix_cache, cfg.cuda_graph) == (256, False, False)
    assert (cfg.max_running_requests, cfg.mem_fraction, cfg.attention_backend) == (7, 0.5, "torch")
    # a ServerArgs name the engine cannot honour is refused by name as unsupported; a name SGLang does
    # not define is unknown
    with pytest.raises(ValueError, match="speculative_algorithm='EAGLE' unsupported"):
        Engine(qwen3_dir, speculative_algorithm="EAGLE", **ARGS)
    with pytest.raises(TypeError, match="unknown server args.*no_such_arg"):
        Engine(qwen3_dir, no_such_arg=1, **ARGS)


def test_generate_shapes_and_greedy_equal_transformers(front, qwen3_dir):
    hf = load_hf(qwen3_dir)
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    one = front.generate(input_ids=PROMPTS[0], sampling_params=greedy, return_logprob=True)
    assert isinstance(one, dict) and set(one) == {"text", "output_ids", "meta_info"}
    assert one["output_ids"] == hf_greedy(hf, PROMPTS[0], 6)
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (7, 6, "0")
    lps = [lp for lp, _, _ in meta["output_token_logprobs"]]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == one["output_ids"]
    assert max(abs(a - b) for a, b in zip(lps, hf_logprobs(hf, PROMPTS[0], one["output_ids"]))) < 1e-4

    batch = front.generate(input_ids=PROMPTS[:2], sampling_params=greedy)
    assert [b["output_ids"] for b in batch] == [hf_greedy(hf, p, 6) for p in PROMPTS[:2]]
    sampled = front.generate(
        input_ids=PROMPTS[:2], sampling_params={"n": 3, "max_new_tokens": 4, "temperature": 1.0, "top_k": 0}
    )
    assert len(sampled) == 6 and all(s["meta_info"]["completion_tokens"] <= 4 for s in sampled)
    text = front.generate(prompt="ab", sampling_params={"max_new_tokens": 3})
    assert isinstance(text, dict) and text["meta_info"]["prompt_tokens"] == len(front.tokenizer.encode("ab"))
    with pytest.raises(ValueError, match="frobnicate"):
        front.generate(prompt="ab", sampling_params={"frobnicate": 1})
    with pytest.raises(ValueError, match="repetition_penalty"):
        front.generate(prompt="ab", sampling_params={"repetition_penalty": 0.0})  # the core's check
    with pytest.raises(TypeError, match="logit_bias"):
        front.generate(prompt="ab", sampling_params={"logit_bias": {"x": 1.0}})


def test_stop_string_trim_and_no_stop_trim(front):
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    full = front.generate(prompt="abc", sampling_params=greedy)["text"]
    stop = full[3:5]  # a string the greedy completion holds
    cut = front.generate(prompt="abc", sampling_params={**greedy, "stop": [stop]})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == full[: full.index(stop)]
    kept = front.generate(prompt="abc", sampling_params={**greedy, "stop": [stop], "no_stop_trim": True})
    assert kept["text"] == full[: full.index(stop)] + stop


def test_async_generate_equals_generate(front):
    import asyncio

    params = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    want = [o["output_ids"] for o in front.generate(input_ids=PROMPTS[:3], sampling_params=params)]

    async def both():
        return await asyncio.gather(
            *(front.async_generate(input_ids=p, sampling_params=params) for p in PROMPTS[:3])
        )

    assert [o["output_ids"] for o in asyncio.run(both())] == want


# -- sampling options, streams, LoRA ----------------------------------------------------------------
OPTIONS = [
    {"temperature": 0, "repetition_penalty": 1.8},
    {"temperature": 0, "presence_penalty": 0.8, "frequency_penalty": 0.5},
    {"temperature": 0, "logit_bias": {"10": 4.0, "66": -5.0}},
    {"temperature": 0, "min_new_tokens": 5, "logit_bias": {str(EOS): 30.0}},
    {"temperature": 1.0, "top_p": 0.95, "sampling_seed": 7, "repetition_penalty": 1.4, "min_new_tokens": 4},
]
NATIVE_NAMES = {"min_new_tokens": "min_tokens", "sampling_seed": "seed"}


def native_params(d: dict, **extra) -> NativeParams:
    """The same options under the core's names, logit_bias keyed by int."""
    fields = {NATIVE_NAMES.get(k, k): v for k, v in d.items()}
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(t): b for t, b in fields["logit_bias"].items()}
    return NativeParams(**fields, **extra)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o))
def test_sampling_options_equal_the_native_engine(front, options):
    out = front.generate(
        input_ids=PROMPTS[0], sampling_params={**options, "max_new_tokens": 12}, return_logprob=True
    )
    front.flush_cache()  # the same prefill as the front's, not one over cached pages
    p = native_params(options, max_new_tokens=12, logprobs=True)
    ref = front.engine.generate(input_ids=[PROMPTS[0]], sampling_params=p)[0].outputs[0]
    assert out["output_ids"] == ref.token_ids
    assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == ref.logprobs
    base = {k: v for k, v in options.items() if k in ("temperature", "top_p", "sampling_seed")}
    plain = front.generate(input_ids=PROMPTS[0], sampling_params={**base, "max_new_tokens": 12})
    assert plain["output_ids"] != out["output_ids"], "the option had no effect"


def test_min_new_tokens_and_penalties_against_the_logit_math(front, qwen3_dir):
    hf = load_hf(qwen3_dir)
    eager = {"temperature": 0, "max_new_tokens": 20, "logit_bias": {str(EOS): 30.0}}
    assert front.generate(input_ids=PROMPTS[0], sampling_params=eager)["output_ids"] == [EOS]
    out = front.generate(input_ids=PROMPTS[0], sampling_params={**eager, "min_new_tokens": 5})
    assert len(out["output_ids"]) == 6 and EOS not in out["output_ids"][:5] and out["output_ids"][5] == EOS
    options = {"presence_penalty": 0.9, "frequency_penalty": 0.4, "repetition_penalty": 1.2}
    greedy = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    got = front.generate(input_ids=PROMPTS[0], sampling_params={**greedy, **options})["output_ids"]
    assert got == hf_greedy_adjusted(hf, PROMPTS[0], NativeParams(temperature=0, **options), 10)


def deltas(chunks: list[dict], index: int | None = None) -> tuple[str, list[int]]:
    """What each cumulative chunk adds to the one before it, joined (SGLang's stream_and_merge)."""
    text, ids = "", []
    for chunk in chunks:
        if index is not None and chunk["index"] != index:
            continue
        assert chunk["text"].startswith(text) and chunk["output_ids"][: len(ids)] == ids
        text += chunk["text"][len(text) :]
        ids += chunk["output_ids"][len(ids) :]
    return text, ids


def test_stream_chunks_add_up_to_the_output(front):
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    whole = front.generate(input_ids=PROMPTS[0], sampling_params=params, return_logprob=True)
    front.flush_cache()  # the same prefill as the whole output's, not one over cached pages
    chunks = list(
        front.generate(input_ids=PROMPTS[0], sampling_params=params, return_logprob=True, stream=True)
    )
    assert len(chunks) > 1 and all("index" not in c for c in chunks)
    assert deltas(chunks) == (whole["text"], whole["output_ids"])
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    # a stop string kept with no_stop_trim ends the stream the way it ends the whole output
    stop = {**params, "stop": [whole["text"][4:6]], "no_stop_trim": True}
    kept = front.generate(input_ids=PROMPTS[0], sampling_params=stop)
    streamed = list(front.generate(input_ids=PROMPTS[0], sampling_params=stop, stream=True))
    assert deltas(streamed)[0] == kept["text"] == whole["text"][: whole["text"].index(stop["stop"][0]) + 2]
    assert streamed[-1]["meta_info"]["finish_reason"] == kept["meta_info"]["finish_reason"]


def test_batched_stream_is_indexed_prompt_major(front):
    params = {"n": 2, "temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 3, "min_new_tokens": 8}
    whole = front.generate(input_ids=PROMPTS[:2], sampling_params=params)
    chunks = list(front.generate(input_ids=PROMPTS[:2], sampling_params=params, stream=True))
    assert sorted({c["index"] for c in chunks}) == [0, 1, 2, 3]
    for i, want in enumerate(whole):
        assert deltas(chunks, i) == (want["text"], want["output_ids"])
        assert [c for c in chunks if c["index"] == i][-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_leaving_a_stream_early_aborts_it(front):
    params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    want = front.generate(input_ids=PROMPTS[1], sampling_params=params)
    for n, _ in enumerate(front.generate(input_ids=PROMPTS[1], sampling_params=params, stream=True)):
        if n == 2:
            break  # the loop drops the iterator: its finally aborts the request
    assert not front.engine.has_unfinished()
    dropped = front.generate(input_ids=PROMPTS[1], sampling_params=params, stream=True)
    next(dropped)
    assert front.engine.has_unfinished()
    del dropped
    gc.collect()
    assert not front.engine.has_unfinished()
    assert front.generate(input_ids=PROMPTS[1], sampling_params=params) == {
        **want,
        "meta_info": {**want["meta_info"], "id": mock.ANY},
    }
    # two open streams share the step loop: each gets all of its own chunks
    a = front.generate(input_ids=PROMPTS[0], sampling_params=params, stream=True)
    b = front.generate(input_ids=PROMPTS[1], sampling_params=params, stream=True)
    both = [(x, y) for x, y in zip(a, b)]
    assert deltas([y for _, y in both])[1] == want["output_ids"]
    assert (
        deltas([x for x, _ in both])[1]
        == front.generate(input_ids=PROMPTS[0], sampling_params=params)["output_ids"]
    )


def test_async_stream(front):
    import asyncio

    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    want = [front.generate(input_ids=p, sampling_params=params)["output_ids"] for p in PROMPTS[:2]]

    async def collect(prompt):
        chunks = await front.async_generate(input_ids=prompt, sampling_params=params, stream=True)
        return [c async for c in chunks]

    async def leave_early():
        chunks = await front.async_generate(input_ids=PROMPTS[0], sampling_params=params, stream=True)
        async for _ in chunks:
            break
        await chunks.aclose()
        return front.engine.has_unfinished()

    async def run():
        streams = await asyncio.gather(*(collect(p) for p in PROMPTS[:2]))
        return streams, await leave_early()

    streams, unfinished = asyncio.run(run())
    assert [deltas(chunks)[1] for chunks in streams] == want and not unfinished
    assert streams[0][-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


def test_lora_path_names_a_loaded_adapter(qwen3_dir, tmp_path):
    base = load_hf(qwen3_dir)
    a, b = peft_model(base, ATTN, 8, seed=1), peft_model(base, MLP, 8, seed=2)
    a.save_pretrained(str(tmp_path / "a"))
    b.save_pretrained(str(tmp_path / "b"))
    e = Engine(qwen3_dir, **ARGS, lora_paths=[f"a={tmp_path / 'a'}"], max_lora_rank=8, max_loras_per_batch=2)
    assert (e.engine.config.max_loras, e.engine.config.max_lora_rank) == (2, 8)
    assert e.load_lora_adapter("b", str(tmp_path / "b"))[0]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    outs = e.generate(
        input_ids=PROMPTS[:3], sampling_params=params, lora_path=["a", "b", None], return_logprob=True
    )
    for out, oracle, prompt in zip(outs, (a, b, base), PROMPTS):
        assert out["output_ids"] == hf_greedy(oracle, prompt, 6)
        lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lps, hf_logprobs(oracle, prompt, out["output_ids"]))) < 1e-4
    streamed = list(e.generate(input_ids=PROMPTS[0], sampling_params=params, lora_path="a", stream=True))
    assert streamed[-1]["output_ids"] == outs[0]["output_ids"]
    ok, msg = e.unload_lora_adapter("b")
    assert ok and "'b'" in msg
    ok, msg = e.load_lora_adapter("c", str(tmp_path))  # not an adapter folder
    assert not ok and "adapter folder" in msg
    with pytest.raises(ValueError, match="'b'"):
        e.generate(input_ids=PROMPTS[0], sampling_params=params, lora_path="b")
    with pytest.raises(ValueError, match="LoRA is off"):
        Engine(qwen3_dir, **ARGS).generate(input_ids=PROMPTS[0], sampling_params=params, lora_path="a")


def test_serializer_round_trip_bytes_and_base64():
    named = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(2, dtype=torch.bfloat16))]
    for as_str in (False, True):
        payload = serialize_tensors(named, output_str=as_str)
        assert isinstance(payload, str if as_str else bytes)
        back = deserialize_tensors(payload)
        assert [n for n, _ in back] == ["a", "b"] and all(
            torch.equal(x, y) for (_, x), (_, y) in zip(back, named)
        )
    local = LocalSerializedTensor(
        values=[MultiprocessingSerializer.serialize(torch.ones(3), output_str=True)]
    )
    assert torch.equal(local.get(0), torch.ones(3))
    with pytest.raises(ValueError, match="base64"):
        MultiprocessingSerializer.deserialize("not base64!")


def test_verl_sharding_manager_flow(front, qwen3_dir):
    """verl: release all, resume weights, per-tensor LocalSerializedTensor per rank, flush, resume KV."""
    trainer = perturbed(qwen3_dir, seed=51)
    assert front.release_memory_occupation() == (True, "released ['cuda_graph', 'kv_cache', 'weights']")
    assert front.resume_memory_occupation(["weights"])[0]
    for name, tensor in trainer.named_parameters():
        gathered = [MultiprocessingSerializer.serialize(tensor.detach())]  # one per TP rank (tp_size=1)
        ok, msg = front.update_weights_from_tensor(
            named_tensors=[(name, LocalSerializedTensor(values=gathered))],
            load_format=None,
            flush_cache=False,
        )
        assert ok, msg
    assert front.flush_cache()[0]
    ok, msg = front.resume_memory_occupation(["kv_cache"])  # the graphs come back with the KV cache
    assert ok and front.engine.released_tags == frozenset(), msg
    assert_weights_equal(front.engine, trainer)
    assert_runs_model(front.engine, trainer)
    got = front.get_weights_by_name("model.norm.weight")
    assert got == trainer.get_parameter("model.norm.weight").float().tolist()
    assert len(front.get_weights_by_name("model.embed_tokens.weight", truncate_size=3)) == 3


def _slime_bucket(named, typed: bool = False) -> dict:
    """slime's bucket: a flat buffer plus (name, shape, dtype, start_idx, end_idx, numel) entries."""
    meta, parts, offset = [], [], 0
    for name, t in named:
        flat = t.contiguous().view(-1) if typed else t.contiguous().view(-1).view(torch.uint8)
        entry = dict(name=name, shape=t.shape, dtype=t.dtype, start_idx=offset, end_idx=offset + flat.numel())
        meta.append({**entry, "numel": flat.numel()})
        parts.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": meta}


def test_slime_flattened_buckets_per_rank(front, qwen3_dir):
    trainer = perturbed(qwen3_dir, seed=52)
    named = state_list(trainer)
    half = len(named) // 2
    for i, chunk in enumerate((named[:half], named[half:])):
        payload = MultiprocessingSerializer.serialize(_slime_bucket(chunk), output_str=True)
        ok, msg = front.update_weights_from_tensor(
            [payload], load_format="flattened_bucket", flush_cache=False, weight_version=f"v{i}"
        )
        assert ok, msg
    # an idle rank's empty bucket is a no-op
    empty = MultiprocessingSerializer.serialize(
        {"flattened_tensor": torch.empty(0, dtype=torch.uint8), "metadata": []}
    )
    assert front.update_weights_from_tensor([empty], load_format="flattened_bucket") == (
        True,
        "empty bucket: nothing to load",
    )
    assert_weights_equal(front.engine, trainer)
    assert_runs_model(front.engine, trainer)
    assert front.get_weight_version() == "v1"
    out = front.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 2})
    assert out["meta_info"]["weight_version"] == "v1"

    # SGLang's older typed layout: one dtype, element offsets
    typed = perturbed(qwen3_dir, seed=53)
    bucket = _slime_bucket(state_list(typed), typed=True)
    assert bucket["flattened_tensor"].dtype == torch.float32
    ok, msg = front.update_weights_from_tensor(bucket, load_format="flattened_bucket")
    assert ok, msg
    assert_weights_equal(front.engine, typed)


@pytest.mark.parametrize(
    "payload, fmt, needle",
    [
        (["not base64!"], "flattened_bucket", "base64"),
        ([b"\x80\x04garbage"], "flattened_bucket", "unpickled"),
        ([("model.norm.weight", torch.ones(3))], None, "shape"),
        ([("model.nope.weight", torch.ones(3))], None, "unknown weight name"),
        ({"flattened_tensor": torch.zeros(4, dtype=torch.uint8), "metadata": [1]}, "flattened_bucket", ""),
        ([("model.norm.weight", torch.ones(64))], "gguf", "load_format"),
    ],
)
def test_bad_payloads_answer_false_and_leave_weights(front, qwen3_dir, payload, fmt, needle):
    model = load_hf(qwen3_dir)
    before = snapshot(front.engine, model)
    ok, msg = front.update_weights_from_tensor(payload, load_format=fmt)
    assert not ok and needle in msg and msg.startswith("update_weights_from_tensor failed"), msg
    assert_same_snapshot(front.engine, before)
    assert front.get_weight_version() == "0"


def test_bad_disk_path_and_group_answer_false(front, qwen3_dir, tmp_path):
    ok, msg = front.update_weights_from_disk(str(tmp_path / "missing"))
    assert not ok and "config.json" in msg
    ok, msg = front.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "nobody")
    assert not ok and "no weights update group named 'nobody'" in msg
    assert not front.destroy_weights_update_group("nobody")[0]
    ok, msg = front.update_weights_from_disk(qwen3_dir, weight_version="disk")
    assert ok and front.get_weight_version() == "disk", msg


# -- broadcast: slime's bucket loop and OpenRLHF's per-tensor loop, from a spawned trainer ------------
def trainer_main(port: int, rounds: list, errors) -> None:
    try:
        import torch.distributed as dist

        pg = sglang_style_group(port, 2, "weight_update_group")
        for fmt, named in rounds:
            if fmt == "flattened_bucket":
                dist.broadcast(
                    torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in named]), 0, pg
                )
            else:
                for _, t in named:
                    dist.broadcast(t.contiguous(), 0, pg)
        dist.destroy_process_group(pg)
    except BaseException:
        errors.put(traceback.format_exc())
        raise


def test_slime_and_openrlhf_broadcast_loops(front, qwen3_dir):
    slime, openrlhf = perturbed(qwen3_dir, seed=54), perturbed(qwen3_dir, seed=55)
    slime_named, orlhf_named = state_list(slime), state_list(openrlhf)
    buckets = [slime_named[:5], slime_named[5:]]
    rounds = [("flattened_bucket", b) for b in buckets] + [(None, [nt]) for nt in orlhf_named]
    port = free_port()
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    trainer = ctx.Process(target=trainer_main, args=(port, rounds, errors))
    trainer.start()
    try:
        ok, msg = front.init_weights_update_group("127.0.0.1", str(port), 1, 2, backend="gloo")
        assert ok, msg
        for i, b in enumerate(buckets):  # slime: names, dtypes (torch dtypes), shapes, a weight_version
            ok, msg = front.update_weights_from_distributed(
                [n for n, _ in b],
                [t.dtype for _, t in b],
                [t.shape for _, t in b],
                flush_cache=i == len(buckets) - 1,
                weight_version="slime-1",
                load_format="flattened_bucket",
            )
            assert ok, msg
        assert_weights_equal(front.engine, slime)
        assert_runs_model(front.engine, slime)
        assert front.get_weight_version() == "slime-1"
        for name, t in orlhf_named:  # OpenRLHF: one name, its dtype string and its shape per call
            ok, msg = front.update_weights_from_distributed(name, str(t.dtype), list(t.shape))
            assert ok, msg
        assert_weights_equal(front.engine, openrlhf)
        assert_runs_model(front.engine, openrlhf)
        assert front.destroy_weights_update_group()[0]
        trainer.join(TIMEOUT)
    finally:
        if trainer.is_alive():
            trainer.kill()
    assert errors.empty() and trainer.exitcode == 0, errors.get() if not errors.empty() else trainer.exitcode
