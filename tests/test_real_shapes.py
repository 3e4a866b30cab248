"""The engine against transformers at the shapes users train, on the CPU, in float32.

Each model is its published config.json (scripts/check_fidelity.py: PUBLISHED, field for field) at its
real widths, head dims, GQA groups and vocabulary, cut to 1-2 layers, with random bfloat16 weights.
Both sides read the same folder; a prompt of 1040 random token ids goes through one prefill (its
logits compared at a spread of positions, including the last) and 8 greedy tokens are generated
(their logprobs compared with a float32 transformers forward over prompt + completion).

The 7B/8B shapes keep one layer: their two embedding matrices alone are ~2.5 GB each in float32. Each
checkpoint is built once, used, and deleted before the next, so peak memory is one model in float32
(engine and transformers never both loaded).
"""

from __future__ import annotations

import gc
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import check_fidelity as cf  # noqa: E402

from rollout import SamplingParams  # noqa: E402
from rollout.models.config import ModelConfig  # noqa: E402

# name -> (layers kept, config.json as written by: "published" file or "transformers" 5's save_pretrained)
CASES = {
    "qwen2.5-0.5b": (2, "published"),
    "qwen2.5-1.5b": (2, "published"),
    "qwen2.5-7b": (1, "published"),
    "qwen3-0.6b": (2, "transformers"),  # rope_parameters, layer_types, dtype
    "qwen3-4b": (1, "published"),
    "qwen3-8b": (1, "published"),
    "llama-3.1-8b": (1, "published"),  # llama3 rope scaling
    "mistral-7b-v0.1": (1, "published"),  # sliding_window 4096
    "qwen3-30b-a3b": (1, "published"),  # 128 experts, top-8, renormalised (tests/test_moe_real.py: routes)
    "qwen1.5-moe-a2.7b": (1, "published"),  # 60 experts, top-4, a shared expert with a sigmoid gate
}
PROMPT_LEN, NEW_TOKENS = 1040, 8
pytestmark = pytest.mark.slow  # minutes, not seconds: still run by default (deselect with -m "not slow")
TOL = 1e-4


@pytest.fixture(scope="session", params=list(CASES))
def real(request, tmp_path_factory):
    """Both sides' outputs for one real-shape model; its checkpoint is deleted afterwards."""
    name = request.param
    layers, fmt = CASES[name]
    folder = cf.build_random(
        name, tmp_path_factory.mktemp(name) / "ckpt", layers=layers, transformers_format=fmt == "transformers"
    )
    try:
        yield name, folder, run_both(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_both(folder: Path) -> dict:
    mc = ModelConfig.from_path(folder)
    prompt = cf.default_prompts(mc.vocab_size, [PROMPT_LEN], seed=1)[0]
    rows = sorted({*range(0, PROMPT_LEN, 61), PROMPT_LEN - 2, PROMPT_LEN - 1})
    engine = cf.make_engine(folder, "torch", "float32", "cpu", [prompt], NEW_TOKENS)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
    out = engine.generate(input_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
    prefill = cf.engine_prompt_logits(engine, prompt, rows)
    del engine
    gc.collect()
    hf = cf.load_hf(folder, torch.float32, "cpu")
    gen_rows = list(range(PROMPT_LEN - 1, PROMPT_LEN - 1 + NEW_TOKENS))  # positions predicting each new token
    ref = cf.hf_logits(hf, prompt + out.token_ids, rows + gen_rows)
    del hf
    gc.collect()
    return dict(
        config=mc,
        prefill=prefill,
        ref_prefill=ref[: len(rows)],
        tokens=out.token_ids,
        logprobs=torch.tensor(out.logprobs, dtype=torch.float64),
        ref_gen=ref[len(rows) :],
    )


def test_shapes_are_the_published_ones(real):
    name, _, res = real
    mc, pub = res["config"], cf.PUBLISHED[name]
    assert mc.vocab_size == pub["vocab_size"] and mc.hidden_size == pub["hidden_size"]
    assert mc.num_heads == pub["num_attention_heads"] and mc.num_kv_heads == pub["num_key_value_heads"]
    assert mc.head_dim == pub.get("head_dim", pub["hidden_size"] // pub["num_attention_heads"])
    assert res["prefill"].shape[-1] == pub["vocab_size"]


def test_prefill_logits_match_transformers(real):
    name, _, res = real
    gap = (res["prefill"] - res["ref_prefill"]).abs().max().item()
    print(f"{name}: prefill logits max gap {gap:.2e}")
    assert gap <= TOL, f"{name}: prefill logits differ from transformers by {gap:.2e}"


def test_greedy_logprobs_match_transformers(real):
    name, _, res = real
    ref_lp = torch.log_softmax(res["ref_gen"].double(), dim=-1)
    tokens = torch.tensor(res["tokens"])
    gap = (res["logprobs"] - ref_lp.gather(1, tokens[:, None])[:, 0]).abs().max().item()
    print(f"{name}: generated logprobs max gap {gap:.2e}")
    assert gap <= TOL, f"{name}: generated logprobs differ from transformers by {gap:.2e}"
    # greedy: each token is transformers' argmax (up to a tie within the tolerance)
    best = ref_lp.max(dim=-1).values
    assert (best - ref_lp.gather(1, tokens[:, None])[:, 0] <= TOL).all()
