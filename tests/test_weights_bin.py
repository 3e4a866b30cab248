"""pytorch_model.bin checkpoints (one file, or shards named by an index) load like safetensors ones,
unpickled with torch.load(weights_only=True): a file holding anything but tensors is refused without
running its code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, hf_greedy
from weights_helpers import load_hf

from rollout import Engine, SamplingParams
from rollout.compat.vllm import LLM
from rollout.compat.vllm import SamplingParams as VllmParams

RAN: list[str] = []


def _ran() -> dict:
    RAN.append("unpickled code ran")
    return {}


class Payload:
    def __reduce__(self):
        return (_ran, ())


def bin_checkpoint(source: str, folder: Path, shards: int = 1) -> str:
    """The safetensors checkpoint `source` rewritten as pytorch_model.bin (sharded with an index)."""
    folder.mkdir()
    for f in Path(source).iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, folder / f.name)
    state = {k: v.contiguous() for k, v in load_hf(source).state_dict().items()}
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return str(folder)
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({n: state[n] for n in names[i::shards]}, folder / part)
        weight_map.update({n: part for n in names[i::shards]})
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(folder)


@pytest.mark.parametrize("shards", [1, 3])
def test_bin_checkpoint_generates_as_transformers(qwen3_dir, tmp_path, shards):
    folder = bin_checkpoint(qwen3_dir, tmp_path / "bin", shards)
    assert not list(Path(folder).glob("*.safetensors"))
    hf = load_hf(qwen3_dir)
    p = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    with Engine(folder, device="cpu", page_size=4, max_total_tokens=512) as engine:
        out = engine.generate(input_ids=[PROMPTS[0]], sampling_params=p)[0].outputs[0].token_ids
        assert out == hf_greedy(hf, PROMPTS[0], 6)
        assert engine.update_weights_from_disk(folder) > 0  # the same reader serves updates


def test_vllm_front_loads_a_bin_checkpoint(qwen3_dir, tmp_path):
    folder = bin_checkpoint(qwen3_dir, tmp_path / "bin")
    llm = LLM(folder, device="cpu", load_format="pt")
    try:
        c = llm.generate(
            {"prompt_token_ids": PROMPTS[1]}, VllmParams(temperature=0, max_tokens=5, ignore_eos=True)
        )
        assert c[0].outputs[0].token_ids == hf_greedy(load_hf(qwen3_dir), PROMPTS[1], 5)
    finally:
        llm.shutdown()


def test_a_bin_file_with_code_is_refused_unrun(qwen3_dir, tmp_path):
    folder = bin_checkpoint(qwen3_dir, tmp_path / "bin")
    state = torch.load(Path(folder) / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "extra": Payload()}, Path(folder) / "pytorch_model.bin")
    with pytest.raises(ValueError, match="not a readable weights-only torch file"):
        Engine(folder, device="cpu", max_total_tokens=256)
    assert RAN == []
