"""Random checkpoints with the real shapes of small Qwen models, for benchmarks (speed does not depend on
the weight values). Each is made once with a transformers config, in bfloat16, and kept in a cache folder.

    python scripts/models.py qwen2.5-0.5b            # prints the folder
    python scripts/models.py qwen2.5-0.5b-thin       # same names and layer count, hidden size 64
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

# The published configs' shapes (vocab 151936; Qwen2.5-0.5B/1.5B and Qwen3-0.6B tie their embeddings).
SHAPES = {
    "qwen2.5-0.5b": dict(
        cls="Qwen2Config", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False,
    ),
    "qwen2.5-1.5b": dict(
        cls="Qwen2Config", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False,
    ),
    "qwen3-0.6b": dict(
        cls="Qwen3Config", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        cls="Qwen2Config", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False, vocab_size=152064,
    ),
}  # fmt: skip
# Qwen3.5 (hybrid: 3 Gated DeltaNet layers to 1 gated-attention layer), text model of the published
# checkpoints (scripts/check_fidelity.py: HYBRID)
QWEN35 = dict(
    cls="Qwen3_5TextConfig", head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, max_position_embeddings=262144, vocab_size=248320, eos_token_id=248044,
    rope_parameters=dict(rope_type="default", rope_theta=10000000, partial_rotary_factor=0.25),
)  # fmt: skip
SHAPES["qwen3.5-2b"] = dict(
    QWEN35, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
    num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True,
)  # fmt: skip
SHAPES["qwen3.5-9b"] = dict(
    QWEN35, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
    num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=False,
)  # fmt: skip
COMMON = dict(vocab_size=151936, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643)
# "<shape>-thin": the shape's layer count, parameter names and flags at a tiny width, so per-tensor host
# costs (weight sync, loading) can be measured without moving the data
THIN = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, vocab_size=1024, bos_token_id=1, eos_token_id=2)  # fmt: skip


def shape_of(name: str) -> dict:
    base = name.removesuffix("-thin")
    if base not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(SHAPES)} (each also as NAME-thin)")
    shape = {**COMMON, **SHAPES[base]}  # a shape's own vocabulary and eos win
    return {**shape, **THIN} if name.endswith("-thin") else shape


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_BENCH_CACHE", Path.home() / ".cache" / "rollout" / "bench"))


def bench_model(name: str, folder: Path | None = None) -> Path:
    """The folder of a random `name`-shaped bf16 checkpoint, made on first use."""
    import torch
    import transformers

    shape = shape_of(name)
    folder = Path(folder or cache_dir() / name)
    if (folder / "config.json").exists():
        return folder
    config = getattr(transformers, shape.pop("cls"))(**shape)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random init of 1.5B params is slow on a CPU
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = folder.with_name(folder.name + ".partial")
    model.save_pretrained(str(tmp))
    tmp.rename(folder)  # complete folders only: an interrupted save is redone next time
    return folder


def model_folder(name: str) -> Path:
    """A benchmark's --model: `tiny` as the built-in model, a shape of SHAPES as its random checkpoint,
    anything else as a checkpoint folder."""
    if name == "tiny":
        from rollout.models.toy import default_model_dir

        return default_model_dir()
    return bench_model(name) if name in SHAPES else Path(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=list(SHAPES), help=f"{sorted(SHAPES)}, or NAME-thin")
    for name in ap.parse_args().names:
        print(bench_model(name))


if __name__ == "__main__":
    main()
