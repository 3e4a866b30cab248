"""Qwen3.5-MoE and Qwen3-Next with experts (hybrid Gated DeltaNet + gated attention, sparse MLPs with a
shared expert) against transformers loaded back from the folder the engine reads, float32 on the CPU.

Tiny widths: prefill logits and generated logprobs within 1e-4, greedy tokens, routes (R3) equal to
transformers' router top-k as a set per token and layer (prompt and generated, chunked prefill, n>1
sharing the prompt's state and pages, a shared prefix, preemption), both checkpoint layouts, a fused
weight update equal to loading the checkpoint, bad expert tensors refused before any write, and the text
tower of a Qwen3_5MoeForConditionalGeneration checkpoint. Qwen3.5-MoE's router always renormalises
(the tiny config has no norm_topk_prob); the Qwen3-Next one does not (norm_topk_prob=False) and keeps
layer 1 dense (mlp_only_layers).

Real widths (slow): the Qwen3.5-35B-A3B text config cut to 2 layers (1 linear + 1 full attention, 256
experts top-8, the 248,320-token vocabulary) with a tied head (untied, each side would hold 2 GB more
than the 13 GB a test may use here: its float32 weights are 8.5 GB tied), and Qwen3-Next-80B-A3B's
widths cut to 2 layers with 32 experts instead of 512 (512 experts are 6.4 GB a layer in float32; they
would not fit), prompts of 1040 tokens: logprobs within 1e-4, routes equal. Engine first, freed, then
transformers: one model at a time. The checkpoints hold the fused experts (transformers 5's layout):
converting 256 experts a layer on load would cost transformers 6 GB of copies here.
"""

from __future__ import annotations

import gc
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import router_top_k
from safetensors.torch import save_file
from test_moe_models import per_expert_names
from test_qwen35 import build_checkpoint, engine, greedy, hf_gap, prompt_of, save_random
from weights_helpers import perturb

from integrations.routing_replay import RoutingReplay
from rollout import Engine, SamplingParams
from rollout.models.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import check_fidelity as cf  # noqa: E402

TOL = 1e-4
NEXT_MOE = dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    norm_topk_prob=False, mlp_only_layers=[1], intermediate_size=96,
)  # fmt: skip
VARIANTS = {"qwen3_5_moe": ("qwen3_5_moe", {}), "qwen3_next_moe": ("qwen3_next", NEXT_MOE)}
MOE_LAYERS = {"qwen3_5_moe": (0, 1, 2, 3), "qwen3_next_moe": (0, 2, 3)}
EXPERT = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid_moe")
    return {name: build_checkpoint(root / name, arch, seed=3, **kw) for name, (arch, kw) in VARIANTS.items()}


@pytest.fixture(scope="module")
def hf(dirs):
    return {name: cf.load_hf(path, torch.float32, "cpu") for name, path in dirs.items()}


@pytest.fixture(params=list(VARIANTS))
def name(request) -> str:
    return request.param


def routed(path, **kw) -> Engine:
    return engine(path, enable_return_routed_experts=True, **kw)


def greedy_routed(n: int) -> SamplingParams:
    return replace(greedy(n), return_routed_experts=True)


def hf_routes(model, tokens: list[int]) -> torch.Tensor:
    """transformers' own router top-k ([T, sparse layers, top_k]) of tokens[:-1] (each token the engine
    ran forward)."""
    with torch.no_grad(), router_top_k(model) as got:
        model.model(torch.tensor([tokens[:-1]]))
    return got[0]


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.sort(-1).values, b.sort(-1).values)


def assert_routes(model, prompt: list[int], out) -> None:
    tokens = prompt + out.token_ids
    r = out.routed_experts
    assert r.dtype == torch.int32 and r.shape[0] == len(tokens) - 1
    assert same_sets(r, hf_routes(model, tokens))


def test_config_reads_the_sparse_layers(dirs, name):
    mc = ModelConfig.from_path(dirs[name])
    assert mc.moe_layers == MOE_LAYERS[name]
    assert mc.moe.num_experts == 8 and mc.moe.top_k == 2 and mc.moe.shared_intermediate_size == 48
    if name == "qwen3_5_moe":
        assert mc.intermediate_size == 0  # no dense MLP, and the config has no such field
        assert "intermediate_size" not in mc.tp_sizes


def test_prefill_decode_and_routes_match_transformers(dirs, hf, name):
    """Chunks of 100 tokens (the DeltaNet kernel's chunk is 64)."""
    prompt = prompt_of(300, seed=21)
    eng = routed(dirs[name], max_prefill_tokens=100)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, logprobs=True,
                            return_routed_experts=True)  # fmt: skip
    out = eng.generate(input_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
    rows = [*range(0, 300, 23), 299]
    model = hf[name]
    assert torch.allclose(
        cf.engine_prompt_logits(eng, prompt, rows), cf.hf_logits(model, prompt, rows), atol=TOL
    )
    assert hf_gap(model, prompt, out) <= TOL
    ref = cf.hf_logits(model, prompt + out.token_ids, range(299, 299 + 24))
    assert out.token_ids == ref.argmax(-1).tolist()
    assert out.routed_experts.shape == (300 + 24 - 1, len(MOE_LAYERS[name]), 2)
    assert_routes(model, prompt, out)


def test_routes_with_shared_prompts_and_preemption(dirs, hf, name):
    """n=4 samples start from the first one's prompt state and pages; a later request of the same prompt
    attaches those pages (routes read from the store, written by the first request); two requests in a
    pool too small for both: one is preempted and recomputed."""
    model, prompt = hf[name], prompt_of(150, seed=23)
    eng = routed(dirs[name], max_running_requests=4)
    n4 = SamplingParams(temperature=1.0, n=4, max_new_tokens=10, ignore_eos=True, logprobs=True,
                        return_routed_experts=True, seed=4)  # fmt: skip
    outs = eng.generate(input_ids=[prompt], sampling_params=n4, use_tqdm=False)[0].outputs
    before = eng.stats.prefill_tokens
    again = eng.generate(input_ids=[prompt], sampling_params=greedy_routed(6))
    assert eng.stats.prefill_tokens - before < len(prompt)  # the kept state's pages were shared
    for out in [*outs, again[0].outputs[0]]:
        assert hf_gap(model, prompt, out) <= TOL
        assert_routes(model, prompt, out)
    prompts = [prompt_of(120, seed=s) for s in range(4)]
    eng = routed(dirs[name], max_total_tokens=16 * 20, max_running_requests=4)
    params = greedy_routed(48)
    outs = eng.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    assert eng.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert_routes(model, p, o.outputs[0])


def test_replay_gives_the_trainer_the_engine_logprobs(dirs, hf, name):
    """integrations.routing_replay on these transformers models (Qwen3.5-MoE's router has no
    norm_topk_prob: it always renormalises): the trainer under the engine's routes computes the
    engine's logprobs."""
    model, prompt = hf[name], prompt_of(80, seed=33)
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=12, ignore_eos=True, logprobs=True,
                            return_routed_experts=True, seed=6)  # fmt: skip
    outs = routed(dirs[name]).generate(input_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs
    replay = RoutingReplay(model)
    try:
        for out in outs:
            tokens = torch.tensor([prompt + out.token_ids])
            with torch.no_grad(), replay.use(out.routed_experts[None].long()):
                logits = model(tokens[:, :-1]).logits[0].double()
            lp = torch.log_softmax(logits, -1)[len(prompt) - 1 :].gather(1, tokens[0, len(prompt) :, None])
            assert np.abs(lp[:, 0].numpy() - np.array(out.logprobs)).max() <= 1e-5
    finally:
        replay.remove()


def fused_state(model) -> dict[str, torch.Tensor]:
    """What a transformers 5 trainer holds: `mlp.experts.gate_up_proj` / `down_proj`."""
    state = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    assert f"{EXPERT}.gate_up_proj" in state
    return state


def test_both_checkpoint_layouts_load_the_same_weights(dirs, hf, name, tmp_path):
    folder = tmp_path / "fused"
    shutil.copytree(dirs[name], folder)
    save_file(fused_state(hf[name]), str(folder / "model.safetensors"), metadata={"format": "pt"})
    per_expert = engine(dirs[name]).weights_checksum()
    fused = engine(folder)
    assert fused.weights_checksum() == per_expert
    assert len([n for n in per_expert if ".experts." in n]) == len(MOE_LAYERS[name]) * 8 * 3
    got = fused.get_weights_by_name(f"{EXPERT}.gate_up_proj")
    assert torch.equal(got, hf[name].get_parameter(f"{EXPERT}.gate_up_proj").detach())
    assert torch.equal(fused.get_weights_by_name(f"{EXPERT}.5.up_proj.weight"), got[5, 32:])


def test_fused_weight_update_equals_loading_the_checkpoint(dirs, name, tmp_path):
    trainer = perturb(cf.load_hf(dirs[name], torch.float32, "cpu"), seed=7)
    trainer.save_pretrained(tmp_path / "new")  # the hub's per-expert layout
    shutil.copy(dirs[name] / "tokenizer.json", tmp_path / "new")
    prompt = prompt_of(120, seed=27)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, logprobs=True, n=2, seed=2,
                            return_routed_experts=True)  # fmt: skip
    ref = routed(tmp_path / "new").generate(input_ids=[prompt], sampling_params=params, use_tqdm=False)
    eng = routed(dirs[name])
    old = eng.generate(input_ids=[prompt], sampling_params=params, use_tqdm=False)
    named = list(fused_state(trainer).items())
    assert eng.update_weights_from_tensor(named) == len(named)
    got = eng.generate(input_ids=[prompt], sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in got[0].outputs] == [o.token_ids for o in ref[0].outputs]
    assert [o.logprobs for o in got[0].outputs] == [o.logprobs for o in ref[0].outputs]
    assert all(
        torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(got[0].outputs, ref[0].outputs)
    )
    assert [o.logprobs for o in got[0].outputs] != [o.logprobs for o in old[0].outputs]
    # the per-expert layout of the same tensors is the same update
    eng2 = routed(dirs[name])
    eng2.update_weights_from_tensor(per_expert_names(named))
    assert eng2.weights_checksum() == eng.weights_checksum()


def test_bad_expert_tensors_are_refused_with_the_weights_intact(dirs, hf, name):
    eng = engine(dirs[name])
    before, version = eng.weights_checksum(), eng.weight_version
    good = list(fused_state(perturb(cf.load_hf(dirs[name], torch.float32, "cpu"), seed=8)).items())
    gate_up = dict(good)[f"{EXPERT}.gate_up_proj"]
    nan = gate_up.clone()
    nan[3, 7, 1] = float("nan")

    def swap(key: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(n, t if n == key else v) for n, v in good]

    cases = {
        "wrong fused shape": (swap(f"{EXPERT}.gate_up_proj", gate_up[:, :-1]), "shape"),
        "wrong expert shape": ([*good, (f"{EXPERT}.2.down_proj.weight", gate_up[2])], "shape"),
        "expert out of range": ([*good, (f"{EXPERT}.8.gate_proj.weight", gate_up[0, :32])], "expert 8"),
        "non-finite expert": (swap(f"{EXPERT}.gate_up_proj", nan), "NaN"),
        "fused and per-expert at once": ([*good, (f"{EXPERT}.4.up_proj.weight", gate_up[4, 32:])],
                                         "both write"),
        "text-tower prefix": ([(f"model.language_model.{EXPERT[6:]}.0.gate_proj.weight", gate_up[0, :32])],
                              "unknown weight name"),
    }  # fmt: skip
    if name == "qwen3_next_moe":  # layer 1 is dense: it has no experts
        cases["dense layer"] = ([("model.layers.1.mlp.experts.0.gate_proj.weight", gate_up[0, :32])],
                                "unknown weight name")  # fmt: skip
    for label, (named, match) in cases.items():
        with pytest.raises((ValueError, TypeError), match=match):
            eng.update_weights_from_tensor(named)
        assert eng.weights_checksum() == before, label
        assert eng.weight_version == version, label
    prompt = prompt_of(60, seed=29)
    out = eng.generate(input_ids=[prompt], sampling_params=greedy(8), use_tqdm=False)[0].outputs[0]
    assert hf_gap(hf[name], prompt, out) <= TOL  # still runs the original weights


def test_conditional_generation_checkpoint_loads_its_text_tower(tmp_path):
    import transformers

    from rollout.models.toy import HYBRID, MOE

    text = dict(
        vocab_size=83, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, shared_expert_intermediate_size=48, **MOE, **HYBRID,
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    model = save_random(transformers.Qwen3_5MoeForConditionalGeneration(cfg), tmp_path)
    prompt = prompt_of(120, seed=31)
    eng = routed(tmp_path)
    names = eng.model.hf_names()
    assert "model.language_model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "model.language_model.layers.0.mlp.shared_expert.gate_proj.weight" in names
    params = greedy_routed(12)
    out = eng.generate(input_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
    tokens = torch.tensor([prompt + out.token_ids])
    with torch.inference_mode(), router_top_k(model) as got:
        hidden = model.model.language_model(tokens[:, :-1]).last_hidden_state[0]
        logp = torch.log_softmax(model.lm_head(hidden).float(), -1)
    ref = logp[len(prompt) - 1 :].gather(1, tokens[0, len(prompt) :, None])[:, 0]
    assert np.abs(np.array(out.logprobs) - ref.numpy()).max() <= TOL
    assert same_sets(out.routed_experts, got[0])
    # the trainer's fused names under the tower's prefix update it
    state = {n: p.detach() for n, p in model.named_parameters() if n.startswith("model.language_model.")}
    fused = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert fused in state
    eng.update_weights_from_tensor([(fused, state[fused] * 0.5)])
    assert torch.equal(eng.get_weights_by_name(fused), state[fused] * 0.5)


# -- real widths -----------------------------------------------------------------------------------
PROMPT_LEN, NEW = 1040, 4
ROWS = sorted({*range(0, PROMPT_LEN, 97), PROMPT_LEN - 1})


def real_width_check(folder: Path, vocab: int) -> None:
    prompt = cf.default_prompts(vocab, [PROMPT_LEN], seed=3)[0]
    eng = routed(folder, max_running_requests=1, max_prefill_tokens=512)
    prefill = cf.engine_prompt_logits(eng, prompt, ROWS)
    params = greedy_routed(NEW)
    out = eng.generate(input_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
    del eng
    gc.collect()
    model = cf.load_hf(folder, torch.float32, "cpu")
    tokens = prompt + out.token_ids
    rows = ROWS + list(range(PROMPT_LEN - 1, PROMPT_LEN - 1 + NEW))
    with router_top_k(model) as got:
        logits = cf.hf_logits(model, tokens, rows)
    del model
    gc.collect()
    assert (prefill - logits[: len(ROWS)]).abs().max().item() <= TOL
    assert np.abs(np.array(out.logprobs) - cf.token_logprobs(logits[len(ROWS) :], out.token_ids)).max() <= TOL
    assert out.token_ids == logits[len(ROWS) :].argmax(-1).tolist()
    assert same_sets(out.routed_experts, got[0][: len(tokens) - 1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,vocab,overrides",
    [
        ("qwen3.5-35b-a3b", 248320, {"tie_word_embeddings": True}),  # untied: 2 GB more a side
        ("qwen3-next-80b-a3b", 151936, {"num_experts": 32}),  # 512 experts: ~13 GB a layer in float32
    ],
)
def test_real_widths_logprobs_and_routes(shape, vocab, overrides, tmp_path):
    types = ["linear_attention", "full_attention"]
    folder = cf.build_random(
        shape, tmp_path / "ckpt", layers=2, device="cpu", as_held=True, layer_types=types, **overrides
    )
    try:
        real_width_check(folder, vocab)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
