"""Shared fixtures: tiny random checkpoints of every supported family, made once per session."""

from __future__ import annotations

import pytest
import torch

from rollout.models.toy import build_checkpoint

# family -> extra config: each variant exercises one loading path
VARIANTS = {
    "llama": dict(
        arch="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
        seed=1,
    ),
    "mistral": dict(arch="mistral", seed=2, num_key_value_heads=1),
    "qwen2": dict(arch="qwen2", seed=3),
    "qwen3": dict(arch="qwen3", seed=4, tie_word_embeddings=True),
}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: str(build_checkpoint(root / name, **kw)) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="session")
def qwen3_dir(checkpoints) -> str:
    return checkpoints["qwen3"]


@pytest.fixture(scope="session")
def hf_models(checkpoints):
    from transformers import AutoModelForCausalLM

    return {
        name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, path in checkpoints.items()
    }
