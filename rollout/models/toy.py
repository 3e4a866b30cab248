"""Tiny random checkpoints made on the spot (no download): for tests, examples and the default job.

The tokenizer is character-level over digits, letters and a few symbols, so synthetic tasks
(arithmetic, copying) read naturally and every character is one token. It has a chat template (plain
"role: content" lines), so /v1/chat/completions and LLM.chat work on the built-in model.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHARS = list(string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=?:.,!()[]\n")
# one "role: content" line per message (every character of it is in CHARS), then "assistant:"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

ARCH_CONFIGS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen3_5": "Qwen3_5TextConfig",  # hybrid: Gated DeltaNet + gated attention, 3 to 1
    "qwen3_next": "Qwen3NextConfig",  # the same mixers; its MLP is dense here (num_experts=0)
    "qwen3_5_moe": "Qwen3_5MoeTextConfig",  # the hybrid with experts and a shared expert in every layer
}
# the sparse blocks of the tiny MoE models: enough experts that top-k is a real choice
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# the linear-attention shape of the hybrids' tiny configs (GQA-like: 2 key heads for 4 value heads)
HYBRID = dict(
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4,
)  # fmt: skip


def build_tokenizer(folder: str | Path) -> Any:
    """A character-level fast tokenizer saved into `folder`; returns it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    return tok


def tiny_config(arch: str = "qwen3", *, vocab_size: int | None = None, **overrides: Any) -> Any:
    """A small transformers config of the given family (float32)."""
    import transformers

    vocab = vocab_size or len(SPECIALS) + len(CHARS)
    base = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch in ("qwen3", "qwen3_moe"):
        base["head_dim"] = 32
    if arch in ("qwen2", "qwen2_moe"):
        base["use_sliding_window"] = False
    if arch in ("qwen2_moe", "qwen3_moe"):
        base.update(MOE, norm_topk_prob=arch == "qwen3_moe")
    if arch in ("qwen2_moe", "qwen3_5_moe"):
        base["shared_expert_intermediate_size"] = 48
    if arch == "mistral":
        base["sliding_window"] = None
    if arch in ("qwen3_5", "qwen3_next", "qwen3_5_moe"):
        base.update(HYBRID, num_hidden_layers=4)  # layers 0-2 linear attention, layer 3 full attention
    if arch == "qwen3_5_moe":
        del base["intermediate_size"]  # every layer is sparse: the config has no dense MLP size
        base.update(MOE)
    if arch == "qwen3_next":
        base["num_experts"] = 0
    base.update(overrides)
    cfg = getattr(transformers, ARCH_CONFIGS[arch])(**base)
    cfg.dtype = "float32"
    return cfg


def build_checkpoint(
    folder: str | Path,
    arch: str = "qwen3",
    *,
    seed: int = 0,
    tokenizer: bool = True,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Save a random `arch` model (and the character tokenizer) into `folder`; returns the folder."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    _spread_weights(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), safe_serialization=True, **kwargs)
    if tokenizer:
        build_tokenizer(folder)
    return folder


def _spread_weights(model: Any) -> None:
    """HF's init (std 0.02) makes tiny models near-uniform; wider weights give peaked, testable outputs."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, and stacks of them (an MoE's fused experts)
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 * 4)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.1)


def default_model_dir() -> Path:
    """The built-in small model (made once, then reused): used when no checkpoint is given."""
    import os

    root = Path(os.environ.get("ROLLOUT_CACHE", Path.home() / ".cache" / "rollout"))
    folder = root / "tiny-qwen3-v2"  # v2: the tokenizer has a chat template
    if not (folder / "config.json").exists():
        build_checkpoint(
            folder,
            "qwen3",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
        )
    return folder
