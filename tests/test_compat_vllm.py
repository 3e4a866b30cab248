"""The vLLM-shaped front and chat input: shapes, greedy outputs against transformers, and TRL
colocate's call sequence (sleep / wake_up / load_weights / reset_prefix_cache / generate)."""

from __future__ import annotations

import pytest
from compat_helpers import chat_checkpoint
from helpers import PROMPTS, hf_greedy, hf_logprobs
from weights_helpers import assert_runs_model, assert_weights_equal, load_hf, perturbed

from rollout import Engine
from rollout import SamplingParams as NativeParams
from rollout.compat.vllm import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def chat_dir(qwen3_dir, tmp_path_factory):
    return chat_checkpoint(qwen3_dir, tmp_path_factory.mktemp("chat") / "ckpt")


@pytest.fixture
def llm(qwen3_dir):
    llm = LLM(qwen3_dir, device="cpu", block_size=4, enable_sleep_mode=True)
    yield llm
    llm.shutdown()


def test_llm_arguments_translate_and_unknown_names_raise(qwen3_dir):
    llm = LLM(
        model=qwen3_dir,
        device="cpu",
        max_model_len=200,
        enable_prefix_caching=False,
        max_num_seqs=5,
        gpu_memory_utilization=0.3,
        seed=3,
        distributed_executor_backend="external_launcher",
    )
    cfg = llm.engine.config
    assert (cfg.max_model_len, cfg.enable_prefix_cache, cfg.max_running_requests) == (200, False, 5)
    assert (cfg.mem_fraction, cfg.seed, llm.llm_engine.model_config.max_model_len) == (0.3, 3, 200)
    with pytest.raises(TypeError, match="pipeline_parallel_size"):
        LLM(qwen3_dir, device="cpu", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1.1)
    assert SamplingParams(top_k=0).native.top_k == SamplingParams(top_k=-1).native.top_k == -1


def test_generate_shapes_and_greedy_equal_transformers(llm, qwen3_dir):
    hf = load_hf(qwen3_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, use_tqdm=False)
    assert all(isinstance(o, RequestOutput) and isinstance(o.outputs[0], CompletionOutput) for o in outs)
    for prompt, out in zip(PROMPTS, outs):
        c = out.outputs[0]
        assert out.prompt_token_ids == prompt and out.finished
        assert c.token_ids == hf_greedy(hf, prompt, 6) and c.finish_reason == "length"
        ref = hf_logprobs(hf, prompt, c.token_ids)
        for token, position, want in zip(c.token_ids, c.logprobs, ref):
            assert len(position) == 2 and position[token].rank == 1  # greedy: the sampled token leads
            assert abs(position[token].logprob - want) < 1e-4
            assert sorted(lp.rank for lp in position.values()) == [1, 2]
            assert isinstance(position[token], Logprob) and position[token].decoded_token is not None
        assert abs(c.cumulative_logprob - sum(ref)) < 1e-3
    text = llm.generate("abc", SamplingParams(max_tokens=3, seed=1))[0]
    assert text.prompt == "abc" and len(text.outputs[0].token_ids) <= 3 and text.outputs[0].logprobs is None
    mixed = llm.generate(["abc", {"prompt_token_ids": PROMPTS[1]}], GREEDY)
    assert mixed[0].prompt_token_ids == llm.get_tokenizer().encode("abc")


def test_stop_strings_and_include_stop_str(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate("abc", greedy)[0].outputs[0].text
    stop = full[3:5]
    cut = llm.generate("abc", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))
    c = cut[0].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (full[: full.index(stop)], "stop", stop)
    kept = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=stop, include_stop_str_in_output=True
    )
    assert llm.generate("abc", kept)[0].outputs[0].text == full[: full.index(stop)] + stop


def test_logprobs_mode_refuses_what_it_cannot_report(qwen3_dir):
    raw = LLM(qwen3_dir, device="cpu")
    with pytest.raises(ValueError, match="raw_logprobs"):
        raw.generate("ab", SamplingParams(temperature=0.7, logprobs=0))
    processed = LLM(qwen3_dir, device="cpu", logprobs_mode="processed_logprobs")
    out = processed.generate("ab", SamplingParams(temperature=0.7, max_tokens=3, logprobs=0, seed=0))
    assert len(out[0].outputs[0].logprobs) == len(out[0].outputs[0].token_ids)
    with pytest.raises(ValueError, match="processed_logprobs"):
        processed.generate("ab", SamplingParams(temperature=0.7, top_k=5, logprobs=0))


def test_trl_colocate_sequence(llm, qwen3_dir):
    """TRL's colocate mode: sleep(2) at start; per step wake weights, load_weights per tensor through
    llm_engine, reset_prefix_cache, wake kv_cache, generate with logprobs=0, sleep(2)."""
    llm.sleep(level=2)
    for seed in (61, 62):
        trainer = perturbed(qwen3_dir, seed=seed)
        llm.wake_up(tags=["weights"])
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        for name, param in trainer.named_parameters():
            model.load_weights([(name, param.detach())])
        llm.reset_prefix_cache()
        llm.wake_up(tags=["kv_cache"])  # the decode graphs come back with it
        assert llm.engine.released_tags == frozenset()
        assert_weights_equal(llm.engine, trainer)
        assert_runs_model(llm.engine, trainer)
        params = SamplingParams(n=1, temperature=0, max_tokens=5, logprobs=0, ignore_eos=True)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS[:2]], sampling_params=params, use_tqdm=False
        )
        for prompt, out in zip(PROMPTS, outs):
            c = out.outputs[0]
            assert c.token_ids == hf_greedy(trainer, prompt, 5)
            assert [len(lp) for lp in c.logprobs] == [1] * 5  # logprobs=0: the sampled token only
        llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="released"):
        llm.generate("ab", params)


def test_sleep_level_1_keeps_the_weights(llm, qwen3_dir):
    before = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)[0].outputs[0].token_ids
    llm.sleep(level=1)
    llm.wake_up()
    assert llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)[0].outputs[0].token_ids == before
    assert_weights_equal(llm.engine, load_hf(qwen3_dir))


# -- chat input --------------------------------------------------------------------------------------
def test_engine_chat_uses_the_template_and_adds_no_second_bos(chat_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_dir)
    engine = Engine(chat_dir, device="cpu")
    conv = [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}]
    params = NativeParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    out = engine.chat(conv, params)[0]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out.prompt == text and out.prompt_token_ids.count(tok.bos_token_id) == 1
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    hf = load_hf(chat_dir)
    assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 4)
    # a batch of conversations, and template kwargs reaching the template
    two = engine.chat([conv, conv[1:]], params, chat_template_kwargs={"add_generation_prompt": False})
    assert [o.prompt for o in two] == [
        tok.apply_chat_template(c, tokenize=False, add_generation_prompt=False) for c in (conv, conv[1:])
    ]
    with pytest.raises(TypeError, match="messages"):
        engine.chat("hi", params)
    # text prompts: the tokenizer's default adds the BOS, add_special_tokens=False does not
    assert engine.generate("ab", params)[0].prompt_token_ids == tok.encode("ab")
    assert engine.generate("ab", params, add_special_tokens=False)[0].prompt_token_ids == tok.encode("ab")[1:]


def test_generate_takes_a_batch_encoding(chat_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_dir)
    engine = Engine(chat_dir, device="cpu")
    params = NativeParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    enc = tok(["abc", "a"], padding=True, return_tensors="pt")
    assert enc["input_ids"].shape[1] == 4  # the short prompt is padded
    outs = engine.generate(enc, params)
    assert [o.prompt_token_ids for o in outs] == [tok.encode("abc"), tok.encode("a")]
    want = engine.generate(input_ids=[tok.encode("abc"), tok.encode("a")], sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]


def test_vllm_chat(chat_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_dir)
    llm = LLM(chat_dir, device="cpu")
    conv = [{"role": "user", "content": "hi"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out) == 1 and out[0].prompt == tok.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True
    )
    assert out[0].prompt_token_ids.count(tok.bos_token_id) == 1
    assert out[0].outputs[0].token_ids == hf_greedy(load_hf(chat_dir), out[0].prompt_token_ids, 3)
