"""Qwen3-MoE and Qwen2-MoE (tiny random checkpoints) against transformers on the CPU, in float32:
logprobs, both checkpoint layouts, weight updates in both layouts, refused bad expert tensors."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import PROMPTS, hf_greedy, hf_logprobs
from safetensors.torch import save_file
from weights_helpers import CPU, load_hf, outputs, perturb

from rollout import Engine
from rollout.models.config import ModelConfig
from rollout.models.toy import build_checkpoint
from rollout.weights.bucket import pack

# Qwen3-MoE: layer 1 dense (mlp_only_layers), 3 and 5 off the sparse step; Qwen2-MoE: a shared expert
VARIANTS = {
    "qwen3_moe": dict(arch="qwen3_moe", seed=11, num_hidden_layers=3, mlp_only_layers=[1]),
    "qwen2_moe": dict(arch="qwen2_moe", seed=12, num_hidden_layers=2),
}
EXPERT = "model.layers.0.mlp.experts"


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {name: str(build_checkpoint(root / name, **kw)) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="session")
def fused_dir(moe_dirs, tmp_path_factory) -> str:
    """The Qwen3-MoE checkpoint as transformers 5 holds it in memory: fused experts names."""
    src = moe_dirs["qwen3_moe"]
    out = tmp_path_factory.mktemp("moe_fused") / "qwen3_moe"
    shutil.copytree(src, out)
    (out / "model.safetensors").unlink()
    state = {n: p.detach().contiguous() for n, p in load_hf(src).named_parameters()}
    assert f"{EXPERT}.gate_up_proj" in state  # the layout this test is about
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def engine_for(path: str) -> Engine:
    return Engine(path, max_total_tokens=1024, **CPU)


@pytest.fixture(params=list(VARIANTS))
def family(request):
    return request.param


def test_config_reads_the_sparse_layers(moe_dirs):
    mc = ModelConfig.from_path(moe_dirs["qwen3_moe"])
    assert mc.moe_layers == (0, 2) and mc.moe.num_experts == 8 and mc.moe.top_k == 2
    assert mc.moe.norm_topk_prob and not mc.moe.shared_intermediate_size and mc.qk_norm
    mc2 = ModelConfig.from_path(moe_dirs["qwen2_moe"])
    assert mc2.moe_layers == (0, 1) and not mc2.moe.norm_topk_prob
    assert mc2.moe.shared_intermediate_size == 48 and mc2.qkv_bias and not mc2.o_bias
    cfg = load_hf(moe_dirs["qwen3_moe"]).config.to_dict()
    assert ModelConfig.from_dict(dict(cfg, decoder_sparse_step=2, mlp_only_layers=[])).moe_layers == (1,)
    assert ModelConfig.from_dict(dict(cfg, decoder_sparse_step=2)).moe_layers == ()  # 1 is dense
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        ModelConfig.from_dict(dict(cfg, num_experts_per_tok=9))


def test_greedy_logprobs_match_transformers(moe_dirs, family):
    engine = engine_for(moe_dirs[family])
    hf = load_hf(moe_dirs[family])
    tokens, logprobs = outputs(engine, [PROMPTS[0], PROMPTS[3]])
    for prompt, toks, lps in zip([PROMPTS[0], PROMPTS[3]], tokens, logprobs):
        assert toks == hf_greedy(hf, prompt, len(toks))
        ref = hf_logprobs(hf, prompt, toks)
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-4


def test_both_checkpoint_layouts_load_the_same_weights(moe_dirs, fused_dir):
    per_expert = engine_for(moe_dirs["qwen3_moe"]).weights_checksum()
    fused = engine_for(fused_dir)
    assert fused.weights_checksum() == per_expert  # every canonical (per-expert) name
    assert len([n for n in per_expert if ".experts." in n]) == 2 * 8 * 3
    # the fused names answer too, as the trainer's tensors
    hf = load_hf(moe_dirs["qwen3_moe"])
    got = fused.get_weights_by_name(f"{EXPERT}.gate_up_proj")
    assert torch.equal(got, hf.get_parameter(f"{EXPERT}.gate_up_proj").detach())
    assert torch.equal(fused.get_weights_by_name(f"{EXPERT}.5.up_proj.weight"), got[5, 32:])


@pytest.mark.parametrize("layout", ["fused", "per_expert", "bucket"])
def test_updates_in_either_layout_run_the_trainer_model(moe_dirs, layout):
    path = moe_dirs["qwen3_moe"]
    engine = engine_for(path)
    trainer = perturb(load_hf(path), seed=3)
    fused = [(n, p.detach()) for n, p in trainer.named_parameters()]
    named = fused if layout != "per_expert" else per_expert_names(fused)
    if layout == "bucket":
        engine.update_weights_from_tensor(pack(named), load_format="flattened_bucket")
    else:
        assert engine.update_weights_from_tensor(named) == len(named)
    for name, t in fused:
        assert torch.equal(engine.get_weights_by_name(name), t), name
    sums = engine.weights_checksum([n for n, _ in fused])
    from rollout.weights.checksum import checksum

    assert sums == {n: checksum(t) for n, t in fused}
    tokens, logprobs = outputs(engine, [PROMPTS[0]])
    assert tokens[0] == hf_greedy(trainer, PROMPTS[0], len(tokens[0]))
    assert max(abs(a - b) for a, b in zip(logprobs[0], hf_logprobs(trainer, PROMPTS[0], tokens[0]))) < 1e-4


def per_expert_names(fused: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The hub's layout of a transformers 5 state: each expert's gate/up/down as its own tensor."""
    out = []
    for name, t in fused:
        if name.endswith("experts.gate_up_proj"):
            base, I = name.removesuffix("gate_up_proj"), t.shape[1] // 2  # noqa: E741
            for e in range(t.shape[0]):
                out += [(f"{base}{e}.gate_proj.weight", t[e, :I]), (f"{base}{e}.up_proj.weight", t[e, I:])]
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            out += [(f"{base}{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
        else:
            out.append((name, t))
    return out


def test_bad_expert_tensors_are_refused_with_the_weights_intact(moe_dirs, tmp_path):
    path = moe_dirs["qwen3_moe"]
    engine = engine_for(path)
    before, version = engine.weights_checksum(), engine.weight_version
    good = [(n, p.detach().clone()) for n, p in perturb(load_hf(path), seed=4).named_parameters()]
    gate_up = dict(good)[f"{EXPERT}.gate_up_proj"]
    nan = gate_up.clone()
    nan[3, 7, 1] = float("nan")

    def swap(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(n, t if n == name else v) for n, v in good]

    cases = {
        "wrong fused shape": (swap(f"{EXPERT}.gate_up_proj", gate_up[:, :-1]), "shape"),
        "wrong expert shape": ([*good, (f"{EXPERT}.2.down_proj.weight", gate_up[2])], "shape"),
        "expert out of range": ([*good, (f"{EXPERT}.8.gate_proj.weight", gate_up[0, :32])], "expert 8"),
        "non-finite expert": (swap(f"{EXPERT}.gate_up_proj", nan), "NaN"),
        "fused and per-expert at once": (
            [*good, (f"{EXPERT}.4.up_proj.weight", gate_up[4, 32:])],
            "both write",
        ),
        "not an experts module": (
            [("model.layers.1.mlp.experts.0.gate_proj.weight", gate_up[0, :32])],
            "unknown weight name",
        ),  # fmt: skip
    }
    for label, (named, match) in cases.items():
        with pytest.raises((ValueError, TypeError), match=match):
            engine.update_weights_from_tensor(named)
        assert engine.weights_checksum() == before, label
        assert engine.weight_version == version, label
    # a checkpoint missing one expert is refused from the headers, before any write
    partial = tmp_path / "partial"
    shutil.copytree(path, partial)
    from safetensors.torch import load_file

    state = load_file(str(partial / "model.safetensors"))
    del state[f"{EXPERT}.3.up_proj.weight"]
    save_file(state, str(partial / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 weights"):
        engine.update_weights_from_disk(str(partial))
    assert engine.weights_checksum() == before
    assert outputs(engine) == outputs(engine_for(path))  # still runs the original weights
    with pytest.raises(ValueError, match="lacks 1 weights"):
        Engine(str(partial), **CPU)


@pytest.mark.parametrize("family", list(VARIANTS))
def test_lora_on_the_attention_of_moe_models_equals_peft(moe_dirs, family):
    pytest.importorskip("peft")
    from test_lora import ATTN, adapter, check_against, greedy, peft_model

    base = load_hf(moe_dirs[family])
    lora = peft_model(base, ATTN, 8, seed=5)
    engine = Engine(moe_dirs[family], max_total_tokens=1024, max_loras=1, max_lora_rank=8, **CPU)
    engine.load_lora_adapter_from_tensors("a", *adapter(lora))
    for name, oracle in (("a", lora), (None, base)):
        out = engine.generate(input_ids=[PROMPTS[0]], sampling_params=greedy(name, prompt_logprobs=0))[0]
        check_against(out, oracle, PROMPTS[0])


def test_discarded_weights_come_back_with_a_fused_update(moe_dirs):
    """release without a backup discards the weights; a transformers 5 update (fused names) covers every
    per-expert name, so the engine generates again and runs the trainer's model."""
    path = moe_dirs["qwen3_moe"]
    engine = engine_for(path)
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    with pytest.raises(RuntimeError, match="discarded"):
        outputs(engine)
    trainer = perturb(load_hf(path), seed=6)
    engine.update_weights_from_tensor([(n, p.detach()) for n, p in trainer.named_parameters()])
    tokens, logprobs = outputs(engine, [PROMPTS[0]])
    assert tokens[0] == hf_greedy(trainer, PROMPTS[0], len(tokens[0]))
