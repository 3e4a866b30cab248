"""LoRA on the hybrid models (Qwen3.5, Qwen3-Next): PEFT adapters on the gated attention, the MLP and the
Gated DeltaNet projections, applied unmerged by the engine, equal transformers running the checkpoint
with the adapter merged in (W + s B A, written to disk and loaded back), float32 on the CPU; two adapters
and the base model in one batch; a target the model does not have is refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_lora import adapter, check_against, greedy, peft_model
from test_qwen35 import build_checkpoint, engine

ARCHS = ["qwen3_5", "qwen3_next"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
PROMPTS = [list(range(5, 16)), [12, 13, 14], [20] * 9]


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """arch -> (checkpoint folder, transformers model loaded from it)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hybrid_lora")
    out = {}
    for arch in ARCHS:
        path = build_checkpoint(root / arch, arch, seed=2)
        out[arch] = path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return out


def merged(base: Path, tensors: dict[str, torch.Tensor], config: dict, folder: Path) -> torch.nn.Module:
    """transformers on a copy of `base` whose weights hold W + s B A for every adapted module."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(base, folder)
    weights = load_file(str(folder / "model.safetensors"))
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / (r**0.5 if config["use_rslora"] else r)
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        weights[f"{module}.weight"] += scale * (b @ a)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def undo_moe_targets(config: dict) -> None:
    """PEFT (0.21 on transformers 5) sends a Qwen3-Next's gate/up/down to its MoE experts' fused
    parameters (target_parameters, with a rank and alpha pattern for them), which a dense config lacks: it
    warns and adapts no MLP. The adapter is plain LoRA; its config says what it would on a dense model."""
    config.update(target_parameters=None, rank_pattern={}, alpha_pattern={})


@pytest.mark.parametrize("arch", ARCHS)
def test_two_adapters_and_the_base_in_one_batch_equal_merged_checkpoints(arch, bases, tmp_path):
    """Adapter "all" targets every linear layer but the head (PEFT's all-linear: attention, MLP and the
    DeltaNet projections), adapter "attn" only the gated attention's q/k/v/o (q_proj is (query | gate)
    per head)."""
    path, base = bases[arch]
    a_all = adapter(peft_model(base, "all-linear", 8, seed=1))
    a_attn = adapter(peft_model(base, ATTN, 16, seed=2, rslora=True))
    modules = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in a_all[0]}
    if arch == "qwen3_5":
        assert modules == {*ATTN, *MLP, "out_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"}
    else:
        assert modules == {*ATTN, "out_proj", "in_proj_qkvz", "in_proj_ba"}
        for config in (a_all[1], a_attn[1]):
            undo_moe_targets(config)
    a_all[1]["target_modules"] = "all-linear"  # as the trainer wrote it (PEFT expands it to a set)
    oracles = {
        "all": merged(path, *a_all, tmp_path / "all"),
        "attn": merged(path, a_attn[0], {**a_attn[1], "target_modules": ATTN}, tmp_path / "attn"),
        None: base,
    }
    eng = engine(path, page_size=4, max_loras=2, max_lora_rank=16)
    eng.load_lora_adapter_from_tensors("all", *a_all)
    eng.load_lora_adapter_from_tensors("attn", *a_attn)
    names = ["all", "attn", None]
    params = [greedy(name, prompt_logprobs=0) for name in names for _ in PROMPTS]
    outs = eng.generate(input_ids=PROMPTS * 3, sampling_params=params, use_tqdm=False)
    for i, out in enumerate(outs):
        name, prompt = names[i // len(PROMPTS)], PROMPTS[i % len(PROMPTS)]
        check_against(out, oracles[name], prompt)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[: len(PROMPTS)] != tokens[-len(PROMPTS) :]  # the adapter matters


def test_a_target_the_model_does_not_have_is_refused_by_name(bases):
    path, base = bases["qwen3_5"]
    tensors, config = adapter(peft_model(base, ["in_proj_qkv"], 8, seed=3))
    eng = engine(path, max_loras=1, max_lora_rank=8)
    for wrong in (["in_proj_qkvz"], ["in_proj_qkv", "lm_head"], ["qkv_proj"]):
        with pytest.raises(ValueError, match=repr(wrong[-1])):
            eng.load_lora_adapter_from_tensors("a", tensors, {**config, "target_modules": wrong})
    renamed = {k.replace("in_proj_qkv", "in_proj_qkvz"): v for k, v in tensors.items()}
    with pytest.raises(ValueError, match="in_proj_qkvz"):
        eng.load_lora_adapter_from_tensors("a", renamed, {**config, "target_modules": "all-linear"})
    assert not eng.lora.adapters
    eng.load_lora_adapter_from_tensors("a", tensors, config)  # the engine is still usable
