"""Does the engine compute what transformers computes, on your checkpoint? Run this first on a new model.

    python scripts/check_fidelity.py --model PATH [--dtype bfloat16] [--prompts FILE] [--backends ...]
    python scripts/check_fidelity.py --random-shape qwen2.5-7b --out DIR [--layers 2]  # build, then check

For each attention backend the engine generates greedily from a few prompts (by default random token
ids, 7, ~511 and ~1500 long), and every prompt and generated token's logprob is compared with float32
transformers reading the same folder (the trainer's recomputation, at its most exact). In a half dtype
transformers in that dtype is compared with float32 too: that gap is what half precision costs anyway,
and the engine passes when its own gap is at most 1.1 times it. In float32 the engine must match within
1e-4. Exits 1 when a backend fails, 0 when all pass.

--prompts FILE: one prompt per line, text (tokenized with the checkpoint's tokenizer) or a JSON list of
token ids. --random-shape NAME builds a random checkpoint with a published model's config (below; all
layers unless --layers) into --out, unless one is there, and checks it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HALF_RATIO = 1.1  # engine gap / transformers-in-the-same-dtype gap
FP32_GAP = 1e-4  # max abs logprob gap in float32
LENGTHS = (7, 511, 1500)

# The published config.json of the models users train (the base models' files on the Hugging Face Hub),
# field for field; build_random cuts num_hidden_layers.
# fmt: off
PUBLISHED: dict[str, dict] = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
        "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.02,
        "intermediate_size": 8960, "max_position_embeddings": 131072, "max_window_layers": 28,
        "model_type": "qwen2", "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
        "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    "qwen3-4b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 9728,
        "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
        "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
    },
    "mistral-7b-v0.1": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
    },
    "mistral-7b-v0.3": {
        "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 32768,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "qwen1.5-moe-a2.7b": {
        "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192,
        "max_window_layers": 21, "model_type": "qwen2_moe", "moe_intermediate_size": 1408,
        "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
        "num_hidden_layers": 24, "num_key_value_heads": 16, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 5632, "sliding_window": 32768, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
}
# The text model of the published Qwen3.5 checkpoints (Qwen/Qwen3.5-0.8B, -2B, -9B: config.json's
# text_config, written down from the published files; the Hub is not reachable from the test machines),
# as the text-only Qwen3_5ForCausalLM reads it. 3 Gated DeltaNet layers to 1 gated-attention layer
# (full_attention_interval 4); partial rotary 0.25 of head_dim 256. Checked on 2026-12-08 against copies of
# the Hub files quoted in public repositories (Qwen3.5-0.8B at revision 2fc06364, 2B, 9B, 35B-A3B, and
# Qwen3-Coder-Next for the Qwen3-Next widths): every width, head count, layer count and tie flag agrees.
QWEN35_COMMON = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "attention_bias": False,
    "attention_dropout": 0.0, "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256,
    "hidden_act": "silu", "initializer_range": 0.02, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 248320,
}
HYBRID: dict[str, dict] = {
    "qwen3.5-0.8b": {
        **QWEN35_COMMON, "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
        "num_attention_heads": 8, "num_key_value_heads": 2, "linear_num_key_heads": 16,
        "linear_num_value_heads": 16, "tie_word_embeddings": True,
    },
    "qwen3.5-2b": {
        **QWEN35_COMMON, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 8, "num_key_value_heads": 2, "linear_num_key_heads": 16,
        "linear_num_value_heads": 16, "tie_word_embeddings": True,
    },
    "qwen3.5-9b": {
        **QWEN35_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
        "num_attention_heads": 16, "num_key_value_heads": 4, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "tie_word_embeddings": False,
    },
    # the text config of Qwen3.5-35B-A3B (a Qwen3_5MoeForConditionalGeneration checkpoint): every layer
    # sparse, 256 experts top-8 (always renormalised) + a shared expert; no dense intermediate_size
    "qwen3.5-35b-a3b": {
        **QWEN35_COMMON, "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "router_aux_loss_coef": 0.001, "output_router_logits": False, "tie_word_embeddings": False,
    },
    # Qwen3-Next-80B-A3B: the same mixers (q|k|v|z and b|a packed per key head), 512 experts top-10
    # renormalised + a shared expert in every layer, Qwen2's 151,936-token vocabulary
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
        "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
        "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
        "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
        "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
}
SHAPES = {**PUBLISHED, **HYBRID}
# fmt: on
# Qwen2.5's long-context setting (its model cards: factor 4 over the native 32768 positions)
QWEN25_YARN = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}


# -- random checkpoints with real shapes ---------------------------------------------------------------
def build_random(
    name: str, out: str | Path, *, layers: int | None = None, seed: int = 0, device: str | None = None,
    transformers_format: bool = False, as_held: bool = False, **overrides,
) -> Path:  # fmt: skip
    """A random bfloat16 checkpoint with `name`'s published config (cut to `layers`) in `out`, whose
    config.json is the published file (or, with transformers_format, the one transformers writes).
    as_held: the parameters under the names transformers 5 holds them by (an MoE's fused experts), in
    shards: neither the save nor transformers' load converts the experts' layout, which at real widths
    costs several GB of copies on each side."""
    import transformers

    out = Path(out)
    cfg = dict(SHAPES[name], **overrides)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        if "layer_types" in cfg:
            cfg["layer_types"] = cfg["layer_types"][:layers]
    tmp = out.with_name(out.name + ".partial")  # complete folders only: an interrupted build is redone
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    config = transformers.AutoConfig.from_pretrained(str(tmp))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device("meta"):  # no transformers init: filling 1B+ values ourselves is 4x faster
        model = transformers.AutoModelForCausalLM.from_config(config, **_dtype_kw(torch.bfloat16))
    model = model.to_empty(device=device)
    model.tie_weights()
    _fill_random(model, seed, config.initializer_range)
    if as_held:
        _save_as_held(model, tmp)
    else:
        model.save_pretrained(str(tmp))
    if not transformers_format:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    del model
    _free()
    tmp.rename(out)
    return out


def _save_as_held(model, folder: Path, shard_bytes: int = 1 << 30) -> None:
    """named_parameters() as they are (a tied weight once), in shards of about `shard_bytes`, with an
    index: one shard's tensors are copied at a time."""
    from safetensors.torch import save_file

    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, p in model.named_parameters():
        if size and size + p.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, p))
        size += p.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(
            {n: t.detach().contiguous().cpu() for n, t in shard},
            str(folder / file),
            metadata={"format": "pt"},
        )
        weight_map.update({n: file for n, _ in shard})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    model.config.save_pretrained(str(folder))


@torch.no_grad()
def _fill_random(model, seed: int, std: float, chunk: int = 1 << 24) -> None:
    """transformers' init scale for matrices; norm weights and biases off their defaults (1 and 0) so
    that a norm or bias the engine dropped would change the output. Drawn in float32 a chunk at a time
    (bfloat16 sampling is slower; a whole float32 embedding would double the memory)."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    buf = torch.empty(chunk, device=dev)
    for name, p in model.named_parameters():  # a tied weight is listed once
        flat = p.view(-1)
        for i in range(0, flat.numel(), chunk):
            part = buf[: min(chunk, flat.numel() - i)]
            if "norm" in name:
                part.uniform_(0.8, 1.2, generator=gen)
            else:
                # matrices and stacks of them (an MoE's fused experts) at the init scale
                part.normal_(0.0, std if p.dim() >= 2 else 0.1, generator=gen)
            flat[i : i + part.numel()].copy_(part)


# -- the two sides ----------------------------------------------------------------------------------
@dataclass
class Run:
    """One prompt's greedy completion on one backend: prompt + completion tokens and the engine's
    logprob of each token after the first (prompt tokens from a prefill, generated ones as sampled)."""

    tokens: list[int]
    logprobs: np.ndarray


def make_engine(path, backend: str, dtype: str, device: str, prompts: list[list[int]], new_tokens: int):
    from rollout import Engine

    budget = sum(len(p) + new_tokens for p in prompts) + 64 * len(prompts)
    return Engine(
        str(path), dtype=dtype, attention_backend=backend, device=device, seed=0,
        max_total_tokens=max(budget, 1024), max_running_requests=len(prompts),
    )  # fmt: skip


def engine_prompt_logits(engine, prompt: list[int], rows=None) -> torch.Tensor:
    """float32 logits at `rows` (default: all) of one prefill of `prompt`. The public API returns the
    logprobs of sampled tokens only, so this steps the runner directly, as tests/test_models.py does."""
    from rollout.sampling import SamplingParams
    from rollout.state.scheduled import ScheduledBatch
    from rollout.state.sequence import Sequence

    seq = Sequence(0, 0, 0, list(prompt), len(prompt), SamplingParams(), 0)
    seq.pages = engine.pages.allocate(-(-len(prompt) // engine.kv.page_size))
    try:
        inputs = engine.runner.prepare(ScheduledBatch([seq], [len(prompt)], decode=False))
        rows = torch.arange(len(prompt)) if rows is None else torch.as_tensor(rows)
        inputs.logit_rows = rows.to(engine.device)
        return engine.runner.forward_logits(inputs)
    finally:
        engine.pages.release(seq.pages)
        seq.pages = []  # a made-up sequence: nothing of it stays (a state slot, for hybrid models)


def engine_runs(engine, prompts: list[list[int]], new_tokens: int) -> list[Run]:
    from rollout import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True, logprobs=True)
    outs = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    runs = []
    for prompt, out in zip(prompts, outs):
        done = out.outputs[0]
        logits = engine_prompt_logits(engine, prompt, rows=range(len(prompt) - 1))
        lp = token_logprobs(logits, prompt[1:])
        runs.append(Run(prompt + done.token_ids, np.concatenate([lp, np.array(done.logprobs)])))
    return runs


def load_hf(path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    kw = {"device_map": device} if device.startswith("cuda") else {}
    return AutoModelForCausalLM.from_pretrained(str(path), **_dtype_kw(dtype), **kw).eval()


@torch.inference_mode()
def hf_logits(model, tokens: list[int], rows) -> torch.Tensor:
    """float32 logits at `rows` of one forward over `tokens` (the head applied to those rows only)."""
    dev = next(model.parameters()).device
    hidden = model.model(torch.tensor([tokens], device=dev)).last_hidden_state[0]
    return model.lm_head(hidden[torch.as_tensor(rows, device=dev)]).float()


@torch.inference_mode()
def hf_token_logprobs(model, tokens: list[int], chunk: int = 256) -> np.ndarray:
    """log_softmax(logits)[next token] at every position but the last, as a trainer recomputes it."""
    dev = next(model.parameters()).device
    hidden = model.model(torch.tensor([tokens], device=dev)).last_hidden_state[0, :-1]
    out = [
        token_logprobs(model.lm_head(hidden[i : i + chunk]).float(), tokens[i + 1 : i + 1 + chunk])
        for i in range(0, hidden.shape[0], chunk)  # a 152k vocabulary: the head a chunk at a time
    ]
    return np.concatenate(out)


def token_logprobs(logits: torch.Tensor, targets: list[int]) -> np.ndarray:
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(targets, device=lp.device).unsqueeze(1)
    return lp.gather(1, idx).squeeze(1).double().cpu().numpy()


# -- the check --------------------------------------------------------------------------------------
@dataclass
class Row:
    backend: str
    tokens: int
    engine_mean: float
    engine_max: float
    half_mean: float | None  # transformers in the engine's dtype vs float32 (None in float32)
    half_max: float | None
    worst: str = ""  # per prompt: where its largest gap is (printed when the row fails)

    @property
    def ratio(self) -> float | None:
        if self.half_mean is None:
            return None
        return self.engine_mean / max(self.half_mean, 1e-12)

    @property
    def passed(self) -> bool:
        if self.half_mean is None:
            return self.engine_max <= FP32_GAP
        return self.ratio <= HALF_RATIO


def check(
    path, backends: list[str], dtype: str, device: str, prompts: list[list[int]], new_tokens: int
) -> list[Row]:
    """One row per backend. Engines first, one at a time, then each transformers model once."""
    runs = {}
    for backend in backends:
        engine = make_engine(path, backend, dtype, device, prompts, new_tokens)
        runs[backend] = engine_runs(engine, prompts, new_tokens)
        del engine
        _free()
    ref = _hf_scores(path, torch.float32, device, runs)
    half = _hf_scores(path, getattr(torch, dtype), device, runs) if dtype != "float32" else None
    rows = []
    for backend, rs in runs.items():
        gaps = [np.abs(r.logprobs - ref[tuple(r.tokens)]) for r in rs]
        gap = np.concatenate(gaps)
        row = Row(backend, gap.size, float(gap.mean()), float(gap.max()), None, None)
        row.worst = "; ".join(_worst(p, g) for p, g in zip(prompts, gaps))
        if half is not None:  # the yardstick, over the same tokens
            hgap = np.concatenate([np.abs(half[k] - ref[k]) for k in _keys(rs)])
            row.half_mean, row.half_max = float(hgap.mean()), float(hgap.max())
        rows.append(row)
    return rows


def _worst(prompt: list[int], gap: np.ndarray) -> str:
    """One prompt's gaps in a few words: a failure says where to look (prompt or generated part,
    early or late positions)."""
    at = int(gap.argmax())
    part = "prompt" if at < len(prompt) - 1 else "generated"
    return f"{len(prompt)} tokens: mean {gap.mean():.2e}, max {gap[at]:.2e} at token {at + 1} ({part})"


def _keys(runs: list[Run]) -> list[tuple[int, ...]]:
    return [tuple(r.tokens) for r in runs]


def _hf_scores(path, dtype: torch.dtype, device: str, runs: dict[str, list[Run]]) -> dict[tuple, np.ndarray]:
    model = load_hf(path, dtype, device)
    scores = {}
    for rs in runs.values():
        for key in _keys(rs):
            if key not in scores:  # backends that generated the same tokens share one forward
                scores[key] = hf_token_logprobs(model, list(key))
    del model
    _free()
    return scores


def table(rows: list[Row], dtype: str) -> str:
    half = dtype != "float32"
    head = f"{'backend':<11}{'tokens':>7}  {'engine vs fp32 HF: mean':>24} {'max':>9}"
    if half:
        head += f"  {f'HF {dtype} vs fp32: mean':>24} {'max':>9}  {'ratio':>6}"
    lines = [head + "  result", "-" * (len(head) + 8)]
    for r in rows:
        line = f"{r.backend:<11}{r.tokens:>7}  {r.engine_mean:>24.3e} {r.engine_max:>9.2e}"
        if half:
            line += f"  {r.half_mean:>24.3e} {r.half_max:>9.2e}  {r.ratio:>6.2f}"
        lines.append(line + ("  ok" if r.passed else "  FAIL"))
        if not r.passed and r.worst:
            lines.append(f"  {r.backend}: {r.worst}")
    rule = f"mean-gap ratio <= {HALF_RATIO}" if half else f"max gap <= {FP32_GAP:g}"
    lines.append(f"(abs logprob gaps over prompt + generated tokens; pass: {rule})")
    return "\n".join(lines)


# -- inputs -----------------------------------------------------------------------------------------
def default_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def read_prompts(file: str | Path, tokenizer) -> list[list[int]]:
    prompts = []
    for line in Path(file).read_text().splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("["):
            prompts.append([int(t) for t in json.loads(line)])
        elif tokenizer is None:
            raise ValueError(f"{file}: text prompts need a tokenizer in the checkpoint; give token-id lists")
        else:
            prompts.append(tokenizer.encode(line))
    return prompts


def available_backends(device: str, dtype: str, head_dim: int) -> list[str]:
    """Every backend that runs here: flashinfer (half dtypes, its head dims), triton, torch."""
    import importlib.util

    from rollout.attention.registry import FLASHINFER_HEAD_DIMS

    if not device.startswith("cuda"):
        return ["torch"]
    names = ["triton", "torch"]
    if dtype != "float32" and head_dim in FLASHINFER_HEAD_DIMS and importlib.util.find_spec("flashinfer"):
        names.insert(0, "flashinfer")
    return names


def _inputs(args, path: Path, new_tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from rollout.models.config import ModelConfig

    mc = ModelConfig.from_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception:  # random checkpoints have none
        tokenizer = None
    if args.prompts:
        return read_prompts(args.prompts, tokenizer)
    # past the context (or the sliding window, where full attention stops being equal) nothing compares
    room = min(mc.max_position_embeddings, mc.sliding_window or mc.max_position_embeddings) - new_tokens
    vocab = min(mc.vocab_size, len(tokenizer)) if tokenizer is not None else mc.vocab_size
    return default_prompts(vocab, sorted({min(n, room) for n in args.lengths}), args.seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (config.json + safetensors)")
    ap.add_argument("--random-shape", choices=sorted(SHAPES), help="build a random checkpoint this shape")
    ap.add_argument("--out", help="folder of the --random-shape checkpoint (reused when there)")
    ap.add_argument("--layers", type=int, help="--random-shape: layers kept (default: all)")
    ap.add_argument("--dtype", help="engine dtype (default: bfloat16 on a GPU, float32 on a CPU)")
    ap.add_argument("--device", help="default: cuda when available, else cpu")
    ap.add_argument("--backends", nargs="+", help="attention backends (default: every one available here)")
    ap.add_argument("--prompts", help="file: one prompt a line, text or a JSON list of token ids")
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="random prompts' lengths")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if bool(args.model) == bool(args.random_shape):
        ap.error("give --model PATH, or --random-shape NAME with --out DIR")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if args.random_shape and not args.out:
        ap.error("--random-shape needs --out DIR")
    path = Path(args.model or args.out)
    if args.random_shape and not (path / "config.json").exists():
        print(f"building a random {args.random_shape} checkpoint in {path}", flush=True)
        build_random(args.random_shape, path, layers=args.layers, seed=args.seed)
    from rollout.models.config import ModelConfig

    head_dim = ModelConfig.from_path(path).head_dim
    backends = args.backends or available_backends(device, dtype, head_dim)
    prompts = _inputs(args, path, args.new_tokens)
    print(f"{path}: {dtype} on {device}, prompts of {[len(p) for p in prompts]} tokens, "
          f"{args.new_tokens} generated each", flush=True)  # fmt: skip
    rows = check(path, backends, dtype, device, prompts, args.new_tokens)
    print(table(rows, dtype))
    return 0 if all(r.passed for r in rows) else 1


def _dtype_kw(dtype: torch.dtype) -> dict:
    """transformers >= 4.56 names the argument `dtype` (and warns on torch_dtype); older ones torch_dtype."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
