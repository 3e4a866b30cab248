"""update_weights_from_disk with a weight_name_filter: only the selected tensors load, every header is
still validated first, and a bad filter leaves the weights as they were."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from weights_helpers import CPU, assert_same_snapshot, hf_weight, perturbed, snapshot

from rollout import Engine

NORMS = ["model.norm.weight", "model.layers.1.input_layernorm.weight"]


@pytest.fixture()
def setup(checkpoints, tmp_path):
    path = checkpoints["qwen2"]
    engine = Engine(path, max_total_tokens=512, **CPU)
    trainer = perturbed(path, seed=11)
    trainer.save_pretrained(tmp_path / "step1")
    return engine, trainer, tmp_path / "step1"


@pytest.mark.parametrize("as_list", [True, False])
def test_filter_loads_only_the_selected_tensors(setup, as_list):
    engine, trainer, folder = setup
    before = snapshot(engine, trainer)
    selected = set(NORMS) | {"model.layers.0.self_attn.k_proj.weight"}  # a fused shard too
    filt = sorted(selected) if as_list else selected.__contains__
    assert engine.update_weights_from_disk(folder, weight_name_filter=filt) == len(selected)
    assert engine.weight_version == 1
    for name, old in before.items():
        got = engine.get_weights_by_name(name)
        if name in selected:
            assert torch.equal(got, hf_weight(trainer, name)), name
            assert not torch.equal(got, old), name
        else:
            assert torch.equal(got, old), f"{name} was not selected but changed"


def test_partial_checkpoint_loads_with_a_filter(setup, tmp_path):
    engine, trainer, folder = setup
    before = snapshot(engine, trainer)
    part = tmp_path / "part"
    part.mkdir()
    (part / "config.json").write_text((folder / "config.json").read_text())
    save_file({n: hf_weight(trainer, n).contiguous() for n in NORMS}, str(part / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks"):  # without a filter a checkpoint must be whole
        engine.update_weights_from_disk(part)
    assert engine.update_weights_from_disk(part, weight_name_filter=lambda n: "norm" in n) == 2
    for n in NORMS:
        assert torch.equal(engine.get_weights_by_name(n), hf_weight(trainer, n))
    assert torch.equal(engine.get_weights_by_name("lm_head.weight"), before["lm_head.weight"])


def test_bad_filters_leave_the_weights_untouched(setup, tmp_path):
    engine, trainer, folder = setup
    before = snapshot(engine, trainer)
    with pytest.raises(ValueError, match=r"weight_name_filter.*not in the checkpoint"):
        engine.update_weights_from_disk(folder, weight_name_filter=["model.norm.weight", "model.nrom.weight"])
    with pytest.raises(TypeError, match="weight_name_filter"):
        engine.update_weights_from_disk(folder, weight_name_filter="model.norm.weight")
    with pytest.raises(TypeError, match="weight_name_filter"):
        engine.update_weights_from_disk(folder, weight_name_filter=[3])
    with pytest.raises(ValueError, match="selected no weight"):
        engine.update_weights_from_disk(folder, weight_name_filter=lambda n: False)
    # a checkpoint with one misshapen tensor outside the filter is still refused: all headers validated
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    tensors = {n: hf_weight(trainer, n).contiguous() for n in NORMS}
    tensors["model.layers.0.post_attention_layernorm.weight"] = torch.ones(3)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights_from_disk(bad, weight_name_filter=NORMS)
    assert engine.weight_version == 0
    assert_same_snapshot(engine, before)
