"""Qwen3.5 and Qwen3-Next (hybrid Gated DeltaNet + gated attention) against transformers, float32 on the
CPU: prefill and 64 generated tokens, chunked prefill with chunk ends off the kernel's chunk size,
preemption and recompute, n=8 samples sharing one prefill, a partial rollout resumed after a pause, a
weight update against loading the new checkpoint, release/resume, and the text tower of a
Qwen3_5ForConditionalGeneration checkpoint. Tiny widths here; tests/test_qwen35_real.py holds the
published widths."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout import AsyncEngine, Engine, SamplingParams
from rollout.models.toy import build_tokenizer, tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import check_fidelity as cf  # noqa: E402

pytestmark = pytest.mark.slow  # engines and transformers models: seconds each (still run by default)
TOL = 1e-4
NEW = 64
ARCHS = ["qwen3_5", "qwen3_next"]


def build_checkpoint(folder: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """transformers' own init (A_log, dt_bias, zero-centred norms as shipped), at std 0.1: peaked enough
    to tell tokens apart, and float32's noise stays near 1e-5 (toy.build_checkpoint's wider weights
    put transformers' own float32 forward 1e-4 from float64)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, max_position_embeddings=4096, initializer_range=0.1, **overrides)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    build_tokenizer(folder)
    return folder


@torch.no_grad()
def save_random(model, folder: Path):
    """A vision-language model with random float32 weights (matrices at 2/sqrt(fan_in), the rest at std
    0.1), saved with the tokenizer into `folder`; returns the model."""
    torch.manual_seed(0)
    model = model.float().eval()
    for p in model.parameters():
        p.normal_(0, 0.1) if p.dim() != 2 else p.normal_(0, 2 / p.shape[1] ** 0.5)
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return model


@pytest.fixture(scope="session")
def hybrid_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    return {arch: build_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def hf_hybrid(hybrid_dirs):
    return {arch: cf.load_hf(path, torch.float32, "cpu") for arch, path in hybrid_dirs.items()}


def prompt_of(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 80, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(path, **kw) -> Engine:
    opts = dict(device="cpu", dtype="float32", attention_backend="torch", max_total_tokens=8192, page_size=16)
    return Engine(str(path), **{**opts, **kw})


def greedy(n=NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, logprobs=True)


def hf_gap(hf, prompt: list[int], out) -> float:
    """Max |engine logprob - transformers logprob| over the generated tokens."""
    ref = cf.hf_token_logprobs(hf, prompt + out.token_ids)[len(prompt) - 1 :]
    return float(np.abs(np.array(out.logprobs) - ref).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_match_transformers(arch, hybrid_dirs, hf_hybrid):
    """Chunks of 100 tokens (the kernel's chunk is 64): the state crosses 3 step boundaries."""
    prompt = prompt_of(300)
    eng = engine(hybrid_dirs[arch], max_prefill_tokens=100)
    out = eng.generate(input_ids=[prompt], sampling_params=greedy(), use_tqdm=False)[0].outputs[0]
    rows = [*range(0, 300, 23), 299]
    logits = cf.engine_prompt_logits(eng, prompt, rows)
    hf = hf_hybrid[arch]
    assert torch.allclose(logits, cf.hf_logits(hf, prompt, rows), atol=TOL, rtol=0)
    assert hf_gap(hf, prompt, out) <= TOL
    # greedy: each token is transformers' argmax after the tokens before it
    ref = cf.hf_logits(hf, prompt + out.token_ids, range(len(prompt) - 1, len(prompt) - 1 + NEW))
    assert out.token_ids == ref.argmax(-1).tolist()


def test_kv_pool_holds_only_the_attention_layers(hybrid_dirs):
    eng = engine(hybrid_dirs["qwen3_5"], max_running_requests=4)
    assert eng.kv.num_layers == 1  # of 4 layers, one is full attention
    shapes = {name: tuple(t.shape) for name, t in eng.state.tensors.items()}
    # 3 linear layers; 4 running slots + 4 snapshot slots + scratch; conv over q|k|v = 2*2*16 + 4*16
    assert shapes == {"conv": (3, 9, 128, 3), "recurrent": (3, 9, 4, 16, 16)}


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_recomputes_the_state(arch, hybrid_dirs, hf_hybrid):
    prompts = [prompt_of(120, seed=s) for s in range(4)]
    eng = engine(hybrid_dirs[arch], max_total_tokens=16 * 20, max_running_requests=4)
    outs = eng.generate(input_ids=prompts, sampling_params=greedy(48), use_tqdm=False)
    assert eng.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert hf_gap(hf_hybrid[arch], prompt, out.outputs[0]) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_n_samples_share_the_prompt_state(arch, hybrid_dirs, hf_hybrid):
    prompt = prompt_of(300, seed=5)
    eng = engine(hybrid_dirs[arch], max_running_requests=8)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, logprobs=True, n=8, seed=3)
    before = eng.stats.prefill_tokens
    outs = eng.generate(input_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs
    # the first sample prefills the prompt, stopping once at 288 (the last page boundary before the
    # last token) to keep the state there; the other 7 start from it and compute 12 tokens each
    assert eng.stats.prefill_tokens - before == 300 + 7 * 12
    assert len({tuple(o.token_ids) for o in outs}) == 8
    for out in outs:
        assert hf_gap(hf_hybrid[arch], prompt, out) <= TOL


def test_shared_prefix_without_kept_state_is_recomputed(hybrid_dirs, hf_hybrid):
    """Another request with the same prompt attaches the cached pages only where a state was kept."""
    eng = engine(hybrid_dirs["qwen3_5"])
    prompt = prompt_of(200, seed=7)
    first = eng.generate(input_ids=[prompt], sampling_params=greedy(8), use_tqdm=False)[0].outputs[0]
    before = eng.stats.prefill_tokens
    again = eng.generate(input_ids=[prompt], sampling_params=greedy(8), use_tqdm=False)[0].outputs[0]
    assert eng.stats.prefill_tokens - before == 200  # n=1: no state kept, nothing shared
    assert again.token_ids == first.token_ids and again.logprobs == first.logprobs
    n2 = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, logprobs=True, n=2)
    eng.generate(input_ids=[prompt], sampling_params=n2, use_tqdm=False)  # keeps the state at 192
    before = eng.stats.prefill_tokens
    third = eng.generate(input_ids=[prompt], sampling_params=greedy(8), use_tqdm=False)[0].outputs[0]
    assert eng.stats.prefill_tokens - before == 200 - 192
    assert third.token_ids == first.token_ids
    assert np.abs(np.array(third.logprobs) - np.array(first.logprobs)).max() <= 1e-5


def test_partial_rollout_resumed_after_a_pause(hybrid_dirs, hf_hybrid):
    prompt = prompt_of(150, seed=9)
    eng = engine(hybrid_dirs["qwen3_5"])
    full = eng.generate(input_ids=[prompt], sampling_params=greedy(), use_tqdm=False)[0].outputs[0]

    async def run():
        ae = AsyncEngine.from_engine(eng)
        try:
            stream = ae.stream(input_ids=prompt, sampling_params=greedy())
            got = []
            async for o in stream:
                got.append(o)
                if sum(len(x.outputs[0].token_ids) for x in got) >= 10:
                    break
            await ae.pause_generation("retract")  # the request's pages and state go; it recomputes
            await ae.continue_generation()
            got += [o async for o in stream]
            return got
        finally:
            ae.close()

    got = asyncio.run(run())
    tokens = sum((o.outputs[0].token_ids for o in got), [])
    logprobs = sum((o.outputs[0].logprobs for o in got), [])
    assert tokens == full.token_ids
    assert np.abs(np.array(logprobs) - np.array(full.logprobs)).max() <= TOL


def test_weight_update_equals_loading_the_checkpoint(hybrid_dirs, tmp_path):
    from safetensors.torch import load_file

    other = build_checkpoint(tmp_path / "other", "qwen3_5", seed=1)
    prompt = prompt_of(200, seed=11)
    params = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True, logprobs=True, n=4, seed=2)
    ref = engine(other).generate(input_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs
    eng = engine(hybrid_dirs["qwen3_5"])
    eng.generate(input_ids=[prompt], sampling_params=params, use_tqdm=False)  # state and snapshots in use
    named = list(load_file(str(other / "model.safetensors")).items())
    assert eng.update_weights_from_tensor(named) == len(named)
    got = eng.generate(input_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.logprobs for o in got] == [o.logprobs for o in ref]
    for name, t in named[:6]:
        assert torch.equal(eng.get_weights_by_name(name), t)


def test_release_and_resume_keep_outputs(hybrid_dirs):
    eng = engine(hybrid_dirs["qwen3_5"])
    prompt = prompt_of(100, seed=13)
    before = eng.generate(input_ids=[prompt], sampling_params=greedy(16), use_tqdm=False)[0].outputs[0]
    eng.release_memory_occupation("kv_cache")
    assert eng.state.tensors is None
    eng.resume_memory_occupation("kv_cache")
    after = eng.generate(input_ids=[prompt], sampling_params=greedy(16), use_tqdm=False)[0].outputs[0]
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs


def test_prompt_logprobs_and_scoring(hybrid_dirs, hf_hybrid):
    eng = engine(hybrid_dirs["qwen3_5"], max_prefill_tokens=70)
    prompt = prompt_of(180, seed=15)
    scores = eng.score(input_ids=[prompt])[0]
    ref = cf.hf_token_logprobs(hf_hybrid["qwen3_5"], prompt)
    got = np.array(scores.logprobs)  # of tokens 1.. (start=1)
    assert np.abs(got - ref).max() <= TOL


def test_conditional_generation_checkpoint_loads_its_text_tower(tmp_path):
    import transformers

    from rollout.models.toy import HYBRID

    text = dict(
        vocab_size=83, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False, **HYBRID,
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    # the text config says untied, the checkpoint's class reads the top config: tied
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    model = save_random(transformers.Qwen3_5ForConditionalGeneration(cfg), tmp_path)
    prompt = prompt_of(120, seed=17)
    eng = engine(tmp_path)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in eng.model.hf_names()
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    assert eng.model_config.tie_word_embeddings
    out = eng.generate(input_ids=[prompt], sampling_params=greedy(16), use_tqdm=False)[0].outputs[0]
    with torch.inference_mode():
        tokens = torch.tensor([prompt + out.token_ids])
        hidden = model.model.language_model(tokens).last_hidden_state[0]
        logp = torch.log_softmax(model.lm_head(hidden).float(), -1)
    ref = logp[len(prompt) - 1 : -1].gather(1, tokens[0, len(prompt) :, None])[:, 0]
    assert np.abs(np.array(out.logprobs) - ref.numpy()).max() <= TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_match_transformers(hybrid_dirs):
    """Decode in CUDA graphs (the Triton state kernel and the conv update captured) against transformers,
    float32, with n=4 sharing the prefill; fla's chunk kernel in prefill when installed. The Triton
    attention backend: the only one with graphs that takes float32. The oracle runs on the GPU too: with
    fla installed, transformers sends its chunked rule to fla, which takes no CPU tensors."""
    prompt = prompt_of(300, seed=19)
    hf = cf.load_hf(hybrid_dirs["qwen3_5"], torch.float32, "cuda")
    eng = Engine(
        str(hybrid_dirs["qwen3_5"]), device="cuda", dtype="float32", attention_backend="triton",
        max_running_requests=8, max_prefill_tokens=100,
    )  # fmt: skip
    assert eng.runner.graphs is not None
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, ignore_eos=True, logprobs=True, n=4, seed=1)
    outs = eng.generate(input_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs
    assert eng.runner.graph_steps > 0
    for out in outs:
        assert hf_gap(hf, prompt, out) <= 1e-3  # TF32 matmuls on the GPU
