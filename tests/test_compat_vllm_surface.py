"""vLLM's surface beyond TRL colocate (test_compat_vllm.py), called as vLLM's own tests and OpenRLHF
call it: EngineArgs and SamplingParams names (honoured, neutral, or refused by name), the fields vLLM
users set (best_of, detokenize, prompt_logprobs, bad_words, allowed_token_ids, logits_processors),
Logprob.rank against transformers, generate(priority=...), vLLM's ValueErrors and texts, max_tokens
fitted into max_model_len, get_num_unfinished_requests, collective_rpc with reload_weights, the
worker_extension_cls hook and OpenRLHF's worker methods, and the wake_up() hint after sleep()."""

from __future__ import annotations

import multiprocessing as mp
import re
import traceback

import pytest
import torch
from helpers import PROMPTS, assert_ranks, hf_greedy
from test_weights_broadcast import TIMEOUT, sglang_style_group
from weights_helpers import assert_runs_model, assert_weights_equal, load_hf, perturbed, state_list

from rollout.compat.vllm import LLM, Logprob, SamplingParams
from rollout.weights.broadcast import free_port

GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)


class Probe:
    """A worker_extension_cls as TRL and OpenRLHF write them: methods reading the worker's state."""

    def report(self, extra: int = 0) -> tuple:
        return str(self.model_config.dtype), self.rank + extra, self.device.type


class Clashing:
    def reload_weights(self) -> None:
        raise AssertionError("never mixed in")


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    # neutral values of EngineArgs the engine has no use for, as frameworks pass them
    llm = LLM(
        qwen3_dir,
        device="cpu",
        block_size=4,
        enable_sleep_mode=True,
        disable_log_stats=True,
        max_logprobs=5,
        enable_chunked_prefill=True,
        kv_cache_dtype="auto",
        data_parallel_size=1,
        pipeline_parallel_size=1,
        scheduling_policy="fcfs",
        worker_extension_cls="test_compat_vllm_surface.Probe",
    )
    yield llm
    llm.shutdown()


def prompt(i: int = 0) -> dict:
    return {"prompt_token_ids": PROMPTS[i]}


def test_engine_args_neutral_accepted_others_refused_by_name(llm, qwen3_dir):
    for name, value in [
        ("kv_cache_dtype", "fp8"),
        ("data_parallel_size", 2),
        ("speculative_config", {"n": 1}),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} unsupported")):
            LLM(qwen3_dir, device="cpu", **{name: value})
    with pytest.raises(ValueError, match="scheduling_policy='priority' unsupported"):
        LLM(qwen3_dir, device="cpu", scheduling_policy="priority")
    with pytest.raises(
        ValueError, match="Requested sample logprobs of 6, which is greater than max allowed: 5"
    ):
        llm.generate(prompt(), SamplingParams(logprobs=6))
    with pytest.raises(ValueError, match="Requested prompt logprobs of 9"):
        llm.generate(prompt(), SamplingParams(prompt_logprobs=9))


def test_generate_priority_and_vllms_value_errors(llm, qwen3_dir):
    hf = load_hf(qwen3_dir)
    outs = llm.generate([prompt(0), prompt(1)], SamplingParams(**GREEDY), use_tqdm=False, priority=[1, 0])
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, PROMPTS[i], 6) for i in (0, 1)]
    assert (
        llm.generate(prompt(), SamplingParams(**GREEDY), priority=3)[0].outputs[0].token_ids
        == outs[0].outputs[0].token_ids
    )
    with pytest.raises(
        ValueError, match=re.escape("The lengths of prompts (2) and priority (1) must be the same.")
    ):
        llm.generate([prompt(0), prompt(1)], SamplingParams(**GREEDY), priority=[1])
    with pytest.raises(
        ValueError, match=re.escape("The lengths of prompts (2) and params (1) must be the same.")
    ):
        llm.generate([prompt(0), prompt(1)], [SamplingParams(**GREEDY)])
    with pytest.raises(ValueError, match="best_of must be greater than or equal to n"):
        SamplingParams(n=2, best_of=1)
    with pytest.raises(ValueError, match="best_of=3 .* unsupported"):
        SamplingParams(n=2, best_of=3)
    assert len(llm.generate(prompt(), SamplingParams(n=2, best_of=2, max_tokens=3))[0].outputs) == 2
    with pytest.raises(ValueError, match="logits_processors=.* unsupported"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        SamplingParams(detokenize=False, stop=["x"])
    with pytest.raises(ValueError, match="structured_outputs=.* unsupported"):
        SamplingParams(structured_outputs={"json": {}})


def test_logprob_rank_is_the_place_in_the_full_distribution(llm, qwen3_dir):
    """A sampled token's rank counts the tokens at least as likely as it, over the whole vocabulary."""
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=11, logprobs=2)
    c = llm.generate(prompt(2), sp)[0].outputs[0]
    hf = load_hf(qwen3_dir)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPTS[2] + c.token_ids])).logits[0, len(PROMPTS[2]) - 1 : -1].float()
    lp = torch.log_softmax(logits, dim=-1)
    got = [pos[t].rank for pos, t in zip(c.logprobs, c.token_ids)]
    assert_ranks(lp, c.token_ids, got)
    assert max(got) > 3, got  # a flat tiny model samples far down
    for i, (pos, t) in enumerate(zip(c.logprobs, c.token_ids)):
        assert all(isinstance(v, Logprob) for v in pos.values())
        assert abs(pos[t].logprob - lp[i, t].item()) < 1e-4
        assert {k for k, v in pos.items() if v.rank in (1, 2)} == set(lp[i].topk(2).indices.tolist())


def test_prompt_logprobs_detokenize_and_truncate(llm, qwen3_dir):
    out = llm.generate(prompt(1), SamplingParams(max_tokens=2, prompt_logprobs=2, detokenize=False, **{
        "temperature": 0, "ignore_eos": True}))[0]  # fmt: skip
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 2
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[1])
    hf = load_hf(qwen3_dir)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([PROMPTS[1]])).logits[0, :-1].float(), dim=-1)
    for i, (tok, pos) in enumerate(zip(PROMPTS[1][1:], out.prompt_logprobs[1:])):
        assert abs(pos[tok].logprob - lp[i, tok].item()) < 1e-4
        assert {k for k, v in pos.items() if v.rank in (1, 2)} == set(lp[i].topk(2).indices.tolist())
        assert pos[tok].decoded_token is None  # detokenize=False
        assert_ranks(lp[i : i + 1], [tok], [pos[tok].rank])  # over the whole vocabulary
    assert max(pos[tok].rank for tok, pos in zip(PROMPTS[1][1:], out.prompt_logprobs[1:])) > 2
    cut = llm.generate(prompt(1), SamplingParams(truncate_prompt_tokens=3, **GREEDY))[0]
    assert cut.prompt_token_ids == PROMPTS[1][-3:]
    assert cut.outputs[0].token_ids == hf_greedy(hf, PROMPTS[1][-3:], 6)


def test_allowed_token_ids_and_bad_words(llm, qwen3_dir):
    hf = load_hf(qwen3_dir)
    tok = llm.get_tokenizer()
    allowed = [5, 9, 11, 40]
    c = llm.generate(prompt(0), SamplingParams(allowed_token_ids=allowed, **GREEDY))[0].outputs[0]
    with torch.no_grad():
        first = hf(torch.tensor([PROMPTS[0]])).logits[0, -1].float()
    assert set(c.token_ids) <= set(allowed) and c.token_ids[0] == allowed[int(first[allowed].argmax())]

    greedy = llm.generate("abc", SamplingParams(**GREEDY))[0].outputs[0]
    word = tok.decode(greedy.token_ids[:2])  # the greedy output's first two tokens, as text
    assert tok.encode(word, add_special_tokens=False) == greedy.token_ids[:2]
    bad = llm.generate("abc", SamplingParams(bad_words=[word], **GREEDY))[0].outputs[0]
    assert bad.token_ids[0] == greedy.token_ids[0] and bad.token_ids[1] != greedy.token_ids[1]
    ids = tok.encode("abc") + greedy.token_ids[:1]
    with torch.no_grad():
        second = hf(torch.tensor([ids])).logits[0, -1].float()
    second[greedy.token_ids[1]] = float("-inf")
    assert bad.token_ids[1] == int(second.argmax())  # the next best
    single = tok.decode(greedy.token_ids[:1])
    never = llm.generate("abc", SamplingParams(bad_words=[single], **GREEDY))[0].outputs[0]
    assert greedy.token_ids[0] not in never.token_ids


def test_max_tokens_fits_max_model_len_and_batch_failure(qwen3_dir):
    llm = LLM(qwen3_dir, device="cpu", max_model_len=40)
    try:
        long = {"prompt_token_ids": list(range(5, 35))}  # 30 tokens: room for 10
        c = llm.generate(long, SamplingParams(max_tokens=20, min_tokens=15, ignore_eos=True))[0].outputs[0]
        assert len(c.token_ids) == 10 and c.finish_reason == "length"
        too_long = {"prompt_token_ids": list(range(5, 50))}
        msg = "The decoder prompt (length 45) is longer than the maximum model length of 40."
        with pytest.raises(ValueError, match=re.escape(msg)):
            llm.generate([long, too_long], SamplingParams(max_tokens=4))
        assert llm.llm_engine.get_num_unfinished_requests() == 0  # nothing of the batch stays queued
        with pytest.raises(ValueError, match=re.escape("(length 40) plus the number of requested output")):
            llm.generate({"prompt_token_ids": list(range(5, 45))}, SamplingParams(max_tokens=4))
        assert (
            len(llm.generate(long, SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids)
            == 4
        )
    finally:
        llm.shutdown()


def test_sleep_hint_names_wake_up_and_level_2_reloads_weights(llm, qwen3_dir):
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match=re.escape("call wake_up() first")) as err:
        llm.generate(prompt(), SamplingParams(**GREEDY))
    assert "resume_memory_occupation" not in str(err.value)
    assert llm.wake_up(["weights"]) is False  # the KV cache still sleeps
    with pytest.raises(RuntimeError, match="wake_up") as err:
        llm.generate(prompt(), SamplingParams(**GREEDY))
    assert "resume_memory_occupation" not in str(err.value)
    assert llm.collective_rpc("reload_weights") == [None]  # vLLM's level-2 idiom
    assert llm.wake_up(["kv_cache"]) is True
    hf = load_hf(qwen3_dir)
    assert llm.generate(prompt(), SamplingParams(**GREEDY))[0].outputs[0].token_ids == hf_greedy(
        hf, PROMPTS[0], 6
    )


def test_collective_rpc_and_the_worker_extension_hook(llm, qwen3_dir):
    assert llm.collective_rpc("report") == [("torch.float32", 0, "cpu")]
    assert llm.collective_rpc("report", args=(2,)) == [("torch.float32", 2, "cpu")]
    assert llm.llm_engine.collective_rpc("report", kwargs={"extra": 1}) == [("torch.float32", 1, "cpu")]
    assert llm.collective_rpc(lambda worker, k: worker.rank + k, args=(5,)) == [5]
    with pytest.raises(AttributeError, match="no method 'nope'"):
        llm.collective_rpc("nope")
    with pytest.raises(ValueError, match=re.escape("the worker already has ['reload_weights']")):
        LLM(qwen3_dir, device="cpu", worker_extension_cls=Clashing)
    as_class = LLM(qwen3_dir, device="cpu", worker_extension_cls=Probe)
    try:
        assert as_class.collective_rpc("report") == [("torch.float32", 0, "cpu")]
    finally:
        as_class.shutdown()


def test_openrlhf_cuda_ipc_method_with_a_host_handle(llm, qwen3_dir):
    """OpenRLHF's update_weight_cuda_ipc, fed the handle reduce_tensor makes (a CPU tensor's here; the
    GPU test below sends a CUDA one)."""
    from torch.multiprocessing.reductions import reduce_tensor

    model = perturbed(qwen3_dir, seed=91)
    try:
        for name, t in state_list(model):
            handles = {"GPU-0": reduce_tensor(t.contiguous())}
            assert llm.collective_rpc(
                "update_weight_cuda_ipc", args=(name, t.dtype, list(t.shape), handles, False)
            )
        assert_weights_equal(llm.engine, model)
        assert_runs_model(llm.engine, model)
    finally:
        llm.collective_rpc("reload_weights")


def ipc_sender(path: str, queue, done) -> None:
    """A trainer process: CUDA IPC handles of its weights (CUDA cannot open a handle in the process
    that made it), kept alive until the engine has loaded them."""
    from torch.multiprocessing.reductions import reduce_tensor

    model = perturbed(path, seed=92).cuda()
    named = [(n, t.contiguous()) for n, t in state_list(model)]
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    queue.put([(n, t.dtype, list(t.shape), {uuid: reduce_tensor(t)}) for n, t in named])
    done.wait(TIMEOUT)


@pytest.mark.gpu
def test_openrlhf_cuda_ipc_on_the_gpu(qwen3_dir):
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    sender = ctx.Process(target=ipc_sender, args=(qwen3_dir, queue, done))
    sender.start()
    llm = LLM(qwen3_dir, dtype="float32", enforce_eager=True)
    try:
        for name, dtype, shape, handles in queue.get(timeout=TIMEOUT):
            llm.collective_rpc("update_weight_cuda_ipc", args=(name, dtype, shape, handles, False))
        assert_weights_equal(llm.engine, perturbed(qwen3_dir, seed=92))
    finally:
        done.set()
        sender.join(TIMEOUT)
        llm.shutdown()


@pytest.mark.gpu
def test_logprob_ranks_on_the_gpu(qwen3_dir):
    """The rank pass on CUDA, with the overlap schedule and decode graphs on (the defaults there)."""
    llm = LLM(qwen3_dir, dtype="float32")
    try:
        sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5, logprobs=1)
        c = llm.generate(prompt(2), sp)[0].outputs[0]
    finally:
        llm.shutdown()
    hf = load_hf(qwen3_dir)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPTS[2] + c.token_ids])).logits[0, len(PROMPTS[2]) - 1 : -1].float()
    assert_ranks(
        torch.log_softmax(logits, dim=-1),
        c.token_ids,
        [pos[t].rank for pos, t in zip(c.logprobs, c.token_ids)],
    )


# -- OpenRLHF's broadcast: init_process_group, then update_weight per tensor, through collective_rpc ---
def trainer(port: int, named: list, errors) -> None:
    try:
        import torch.distributed as dist

        pg = sglang_style_group(port, 2, "openrlhf")
        for _, t in named:
            dist.broadcast(t.contiguous(), 0, pg)
        dist.destroy_process_group(pg)
    except BaseException:
        errors.put(traceback.format_exc())
        raise


@pytest.mark.slow
def test_openrlhf_init_process_group_and_update_weight(llm, qwen3_dir):
    model = perturbed(qwen3_dir, seed=93)
    named = state_list(model)
    port = free_port()
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    proc = ctx.Process(target=trainer, args=(port, named, errors))
    proc.start()
    try:
        # OpenRLHF's args: master_address, master_port, rank_offset, world_size, group_name, backend, use_ray
        llm.collective_rpc("init_process_group", args=("127.0.0.1", port, 1, 2, "openrlhf", "gloo", False))
        for name, t in named:
            llm.collective_rpc("update_weight", args=(name, t.dtype, list(t.shape), False))
        assert_weights_equal(llm.engine, model)
        proc.join(TIMEOUT)
    finally:
        if proc.is_alive():
            proc.kill()
        llm.collective_rpc("reload_weights")
    assert errors.empty() and proc.exitcode == 0, errors.get() if not errors.empty() else proc.exitcode
    with pytest.raises(ValueError, match="use_ray=True"):
        llm.collective_rpc("init_process_group", args=("127.0.0.1", port, 1, 2, "x", "gloo", True))
