"""The vLLM-shaped front and chat input: shapes, greedy outputs against transformers, and TRL
colocate's call sequence (sleep / wake_up / load_weights / reset_prefix_cache / generate)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from compat_helpers import chat_checkpoint
from helpers import PROMPTS, hf_greedy, hf_logprobs
from test_lora import ATTN, MLP, peft_model
from test_sampling_options import EOS, hf_greedy_adjusted
from weights_helpers import assert_runs_model, assert_weights_equal, load_hf, perturbed

from rollout import Engine
from rollout import SamplingParams as NativeParams
from rollout.compat.vllm import LLM, CompletionOutput, Logprob, LoRARequest, RequestOutput, SamplingParams

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
    # an EngineArgs name the engine cannot honour is refused by name as unsupported; one vLLM does not
    # define is unknown
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 unsupported"):
        LLM(qwen3_dir, device="cpu", pipeline_parallel_size=2)
    with pytest.raises(TypeError, match="unknown arguments.*no_such_arg"):
        LLM(qwen3_dir, device="cpu", no_such_arg=1)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)  # the core's validation, naming the field
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


def test_logprobs_modes(qwen3_dir):
    """raw_logprobs: the core's raw ones, refused at temperatures where they differ from vLLM's (taken
    before temperature); processed_logprobs: the core's processed ones, truncation included."""
    raw = LLM(qwen3_dir, device="cpu")
    with pytest.raises(ValueError, match="raw_logprobs"):
        raw.generate("ab", SamplingParams(temperature=0.7, logprobs=0))
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(qwen3_dir, device="cpu", logprobs_mode="raw_logits")
    processed = LLM(qwen3_dir, device="cpu", logprobs_mode="processed_logprobs")
    options = dict(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3, seed=4)
    out = processed.generate(
        [{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=8, logprobs=0, **options)
    )
    c = out[0].outputs[0]
    want = NativeParams(max_new_tokens=8, logprobs=True, logprobs_mode="processed", **options)
    ref = processed.engine.generate(input_ids=[PROMPTS[0]], sampling_params=want)[0].outputs[0]
    assert c.token_ids == ref.token_ids
    assert [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] == ref.logprobs
    assert all(lp[t].logprob > -math.inf for t, lp in zip(c.token_ids, c.logprobs))


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


# -- sampling options, max_tokens, LoRA -------------------------------------------------------------
OPTIONS = [
    dict(temperature=0, repetition_penalty=1.8),
    dict(temperature=0, presence_penalty=0.8, frequency_penalty=0.5),
    dict(temperature=0, logit_bias={10: 4.0, 66: -5.0}),
    dict(temperature=0, min_tokens=5, logit_bias={EOS: 30.0}),
    dict(temperature=1.0, top_p=0.95, seed=7, repetition_penalty=1.4, frequency_penalty=0.3, min_tokens=4),
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o))
def test_sampling_options_equal_the_native_engine(llm, options):
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    c = llm.generate(prompt, SamplingParams(max_tokens=12, logprobs=0, **options))[0].outputs[0]
    native = NativeParams(max_new_tokens=12, logprobs=True, **options)
    llm.reset_prefix_cache()  # the same prefill as the front's, not one over cached pages
    ref = llm.engine.generate(input_ids=[PROMPTS[0]], sampling_params=native)[0].outputs[0]
    assert (c.token_ids, c.finish_reason) == (ref.token_ids, ref.finish_reason)
    assert [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] == ref.logprobs
    base = {k: v for k, v in options.items() if k in ("temperature", "top_p", "seed")}
    plain = llm.generate(prompt, SamplingParams(max_tokens=12, **base))[0].outputs[0]
    assert plain.token_ids != c.token_ids, "the option had no effect"


def test_penalties_and_bias_equal_the_logit_math(llm, qwen3_dir):
    """Greedy through the front equals greedy over transformers' logits adjusted in plain torch."""
    hf = load_hf(qwen3_dir)
    options = dict(presence_penalty=0.9, frequency_penalty=0.4, repetition_penalty=1.2, logit_bias={12: 2.0})
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **options)
    c = llm.generate([{"prompt_token_ids": PROMPTS[0]}], sp)[0].outputs[0]
    assert c.token_ids == hf_greedy_adjusted(hf, PROMPTS[0], NativeParams(temperature=0, **options), 10)
    # a huge repetition penalty: no token of the prompt or the output comes twice
    never = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1e4)
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for prompt in PROMPTS[:3]:
        toks = llm.generate([{"prompt_token_ids": prompt}], never)[0].outputs[0].token_ids
        assert len(set(toks)) == len(toks) and not set(toks) & set(prompt), toks
    repeats = [llm.generate([{"prompt_token_ids": p}], plain)[0].outputs[0].token_ids for p in PROMPTS[:3]]
    assert any(len(set(t)) < len(t) for t in repeats), "plain greedy repeats nothing: the check is empty"


def test_max_tokens_default_is_16_and_none_runs_to_max_model_len(qwen3_dir):
    assert SamplingParams().max_tokens == 16  # vLLM's default
    llm = LLM(qwen3_dir, device="cpu", max_model_len=40)
    greedy = dict(temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    default = llm.generate([prompt], SamplingParams(**greedy))[0].outputs[0].token_ids
    assert len(default) == 16
    outs = llm.generate([prompt, "abc"], SamplingParams(max_tokens=None, **greedy))
    for out in outs:
        c = out.outputs[0]
        assert len(out.prompt_token_ids) + len(c.token_ids) == 40 and c.finish_reason == "length"
    assert outs[0].outputs[0].token_ids[:16] == default and outs[1].prompt == "abc"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": list(range(5, 45))}], SamplingParams(max_tokens=None))


@pytest.fixture(scope="module")
def lora_folders(qwen3_dir, tmp_path_factory):
    """Two PEFT adapters saved as folders, with their PEFT models (the oracles)."""
    base = load_hf(qwen3_dir)
    models, folders = {None: base}, {}
    for name, targets, seed in (("a", ATTN, 1), ("b", MLP, 2)):
        models[name] = peft_model(base, targets, 8, seed=seed)
        folders[name] = str(tmp_path_factory.mktemp(f"lora_{name}"))
        models[name].save_pretrained(folders[name])
    return models, folders


def test_lora_requests_load_on_first_use(qwen3_dir, lora_folders):
    models, folders = lora_folders
    llm = LLM(qwen3_dir, device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8)
    assert (llm.engine.config.max_loras, llm.engine.config.max_lora_rank) == (1, 8)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    a, b = LoRARequest("a", 1, folders["a"]), LoRARequest("b", 2, folders["b"])
    outs = llm.generate(prompts, sp, lora_request=[a, None])  # one per prompt; None: the base model
    first = outs[0].outputs[0]
    assert first.token_ids == hf_greedy(models["a"], PROMPTS[0], 6)
    want = hf_logprobs(models["a"], PROMPTS[0], first.token_ids)
    np.testing.assert_allclose(
        [lp[t].logprob for t, lp in zip(first.token_ids, first.logprobs)], want, atol=1e-4
    )
    assert outs[1].outputs[0].token_ids == hf_greedy(models[None], PROMPTS[1], 6)
    # the native LoRA path gives the same tokens and logprobs
    native = Engine(qwen3_dir, device="cpu", max_loras=1, max_lora_rank=8)
    native.load_lora_adapter("a", folders["a"])
    p = [
        NativeParams(temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=True, lora_name=name)
        for name in ("a", None)
    ]  # the same batch as the front's
    ref = native.generate(input_ids=PROMPTS[:2], sampling_params=p)[0].outputs[0]
    assert ref.token_ids == first.token_ids
    assert [lp[t].logprob for t, lp in zip(first.token_ids, first.logprobs)] == ref.logprobs

    def tokens(request):
        return llm.generate(prompts[0], sp, lora_request=request)[0].outputs[0].token_ids

    # one slot: b evicts a (the least recently used), and a comes back from its folder
    assert tokens(b) == hf_greedy(models["b"], PROMPTS[0], 6) != first.token_ids
    assert sorted(llm.engine.lora.adapters) == ["b"]
    assert tokens(a) == first.token_ids
    # the same name with another lora_int_id is reloaded from its path
    assert tokens(LoRARequest("a", 3, folders["b"])) == hf_greedy(models["b"], PROMPTS[0], 6)
    with pytest.raises(ValueError, match="max_loras"):
        llm.generate(prompts, sp, lora_request=[a, b])
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(prompts, sp, lora_request=[a])
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(qwen3_dir, device="cpu").generate(prompts[0], sp, lora_request=a)


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
