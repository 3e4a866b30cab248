"""config.json read as transformers reads it, RoPE as transformers computes it, and clear config errors.

RoPE is checked three ways: the engine's cos/sin table against transformers' own rotary module at the
real long-context settings (Qwen2.5 yarn, Llama-3.1 llama3), and tiny models of every rope type run
end to end against transformers at positions past their (small) original context.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import hf_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import check_fidelity as cf  # noqa: E402

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.layers.rotary import Rotary, standalone_config  # noqa: E402
from rollout.models.config import REQUIRED, ModelConfig  # noqa: E402
from rollout.models.toy import build_checkpoint  # noqa: E402


def write_config(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def hf_rotary(hf_config):
    """transformers' own rotary module for this config (the oracle's, not a re-derivation)."""
    import transformers

    name = hf_config.architectures[0]
    module = sys.modules[getattr(transformers, name).__module__]
    return getattr(module, name.removesuffix("ForCausalLM") + "RotaryEmbedding")(hf_config)


def assert_table_matches(mc: ModelConfig, positions: list[int], max_positions: int) -> Rotary:
    ours = Rotary(mc.head_dim, max_positions, hf_config=mc.hf_config)
    rotary = hf_rotary(mc.hf_config)
    pos = torch.tensor([positions])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
    half = mc.head_dim // 2
    torch.testing.assert_close(ours.cos_sin[pos[0], :half], cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.cos_sin[pos[0], half:], sin[0, :, :half], atol=1e-6, rtol=0)
    return ours


# -- the published configs -------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(cf.PUBLISHED))
def test_published_and_transformers5_files_read_the_same(name, tmp_path):
    """The published file and the one transformers 5 writes for it (rope_parameters, layer_types, dtype)
    give the same model facts and the same RoPE table."""
    from transformers import AutoConfig

    published = write_config(tmp_path / "published", cf.PUBLISHED[name])
    AutoConfig.from_pretrained(str(published)).save_pretrained(str(tmp_path / "written"))
    written = json.loads((tmp_path / "written" / "config.json").read_text())
    assert "rope_parameters" in written and "dtype" in written
    a, b = ModelConfig.from_path(published), ModelConfig.from_path(tmp_path / "written")
    assert a == b
    ra, rb = (Rotary(m.head_dim, 4096, hf_config=m.hf_config) for m in (a, b))
    assert torch.equal(ra.cos_sin, rb.cos_sin)


EXPECTED = {  # name: (head_dim, GQA group, tied, sliding window the engine honours, rope type)
    "qwen2.5-0.5b": (64, 7, True, None, "default"),
    "qwen2.5-1.5b": (128, 6, True, None, "default"),
    "qwen2.5-7b": (128, 7, False, None, "default"),  # sliding_window 131072 but use_sliding_window false
    "qwen3-0.6b": (128, 2, True, None, "default"),
    "qwen3-4b": (128, 4, True, None, "default"),
    "qwen3-8b": (128, 4, False, None, "default"),
    "llama-3.1-8b": (128, 4, False, None, "llama3"),
    "mistral-7b-v0.1": (128, 4, False, 4096, "default"),
    "mistral-7b-v0.3": (128, 4, False, None, "default"),
}


@pytest.mark.parametrize("name", list(cf.PUBLISHED))
def test_published_config_facts(name, tmp_path):
    mc = ModelConfig.from_path(write_config(tmp_path, cf.PUBLISHED[name]))
    head_dim, group, tied, window, kind = EXPECTED[name]
    assert (mc.head_dim, mc.num_heads // mc.num_kv_heads, mc.tie_word_embeddings) == (head_dim, group, tied)
    assert mc.sliding_window == window
    assert (mc.rope_scaling or {}).get("rope_type", "default") == kind
    assert mc.torch_dtype == "bfloat16" and mc.eos_token_ids == (cf.PUBLISHED[name]["eos_token_id"],)
    assert mc.qkv_bias == (mc.architecture == "Qwen2ForCausalLM") and not mc.o_bias and not mc.mlp_bias


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen3-0.6b", "mistral-7b-v0.3"])
def test_default_rope_is_transformers_own(name, tmp_path):
    """The plain-RoPE formula the engine writes out equals each model's transformers rotary module
    (and its compute_default_rope_parameters where transformers has one)."""
    mc = ModelConfig.from_path(write_config(tmp_path, cf.PUBLISHED[name]))
    ours = assert_table_matches(
        mc, [0, 1, 1000, 4097, mc.max_position_embeddings - 1], mc.max_position_embeddings
    )
    rotary = hf_rotary(mc.hf_config)
    assert torch.equal(ours.inv_freq, rotary.inv_freq.float()) and rotary.attention_scaling == 1.0
    if hasattr(rotary, "compute_default_rope_parameters"):  # transformers 5
        inv, scale = rotary.compute_default_rope_parameters(mc.hf_config)
        assert torch.equal(ours.inv_freq, inv.float()) and scale == 1.0


def test_llama_default_rope_is_transformers_own(tmp_path):
    cfg = dict(cf.PUBLISHED["llama-3.1-8b"], rope_scaling=None, head_dim=128)
    mc = ModelConfig.from_path(write_config(tmp_path, cfg))
    assert mc.rope_scaling is None
    assert_table_matches(mc, [0, 3, 8192, 131071], mc.max_position_embeddings)


def test_qwen25_yarn_at_the_real_setting(tmp_path):
    """Qwen2.5's long-context setting as its model card writes it (legacy `type` key): transformers'
    frequencies and attention factor, at positions up to 4x the native 32768."""
    cfg = dict(cf.PUBLISHED["qwen2.5-7b"], rope_scaling=cf.QWEN25_YARN)
    mc = ModelConfig.from_path(write_config(tmp_path, cfg))
    assert mc.rope_scaling["rope_type"] == "yarn"
    ours = assert_table_matches(mc, [0, 1, 4095, 32767, 32768, 65537, 131071], mc.max_position_embeddings)
    rotary = hf_rotary(mc.hf_config)
    assert torch.equal(ours.inv_freq, rotary.inv_freq.float())
    assert ours.attention_scaling == rotary.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_llama31_rope_at_the_real_setting(tmp_path):
    mc = ModelConfig.from_path(write_config(tmp_path, cf.PUBLISHED["llama-3.1-8b"]))
    ours = assert_table_matches(mc, [0, 7, 8191, 8192, 50000, 131071], mc.max_position_embeddings)
    rotary = hf_rotary(mc.hf_config)
    assert torch.equal(ours.inv_freq, rotary.inv_freq.float()) and ours.attention_scaling == 1.0
    # llama3 scaling leaves the high frequencies and divides the lowest by the factor (8)
    plain = 1.0 / 500000.0 ** (torch.arange(0, 128, 2).float() / 128)
    assert ours.inv_freq[0] == plain[0]
    assert ours.inv_freq[-1] == pytest.approx(plain[-1].item() / 8.0, rel=1e-6)


# -- every rope type end to end, past the original context ------------------------------------------
ORIG = 64
ROPES = {  # family, rope_scaling (original context 64), max_model_len, prompt length
    "yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
             None, 200),
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": ORIG}, None, 200),
    "linear": ("mistral", {"rope_type": "linear", "factor": 2.0}, None, 200),
    "dynamic": ("qwen3", {"rope_type": "dynamic", "factor": 2.0}, None, 200),  # fixed below max_positions
    "longrope": ("llama", {"rope_type": "longrope", "short_factor": [1.0 + i / 16 for i in range(16)],
                           "long_factor": [2.0 + i / 4 for i in range(16)], "factor": 4.0,
                           "original_max_position_embeddings": ORIG}, ORIG, 50),  # short factors only
}  # fmt: skip


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_types_match_transformers_end_to_end(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    family, scaling, max_len, n = ROPES[kind]
    folder = build_checkpoint(
        tmp_path, family, seed=5, tokenizer=False, hidden_size=128, num_attention_heads=4,
        head_dim=32, max_position_embeddings=256, rope_scaling=scaling,
    )  # fmt: skip
    engine = Engine(str(folder), dtype="float32", max_total_tokens=512, max_model_len=max_len)
    assert engine.model_config.rope_scaling["rope_type"] == kind
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompt = cf.default_prompts(engine.model_config.vocab_size, [n], seed=2)[0]
    ours = cf.engine_prompt_logits(engine, prompt)
    ref = cf.hf_logits(hf, prompt, range(n))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    new = min(12, (max_len or 256) - n)
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True, logprobs=True)
    out = engine.generate(input_ids=prompt, sampling_params=params)[0].outputs[0]
    gap = max(abs(a - b) for a, b in zip(out.logprobs, hf_logprobs(hf, prompt, out.token_ids)))
    assert gap < 1e-4


def test_rope_types_that_transformers_recomputes_are_refused_past_their_fixed_range(tmp_path):
    family, scaling, _, _ = ROPES["longrope"]
    folder = build_checkpoint(
        tmp_path, family, tokenizer=False, hidden_size=128, num_attention_heads=4, head_dim=32,
        max_position_embeddings=256, rope_scaling=scaling,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"rope_type 'longrope'.*max_model_len <= 64"):
        Engine(str(folder), dtype="float32", max_total_tokens=512)  # max_model_len defaults to 256
    with pytest.raises(ValueError, match=r"rope_type 'dynamic'.*max_model_len <= 128"):
        dynamic = standalone_config(32, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, max_positions=128)
        Rotary(32, 256, hf_config=dynamic)
    with pytest.raises(ValueError, match="rope_type 'foo' is not supported"):
        Rotary(32, 64, scaling={"rope_type": "foo", "factor": 2.0})


def test_dynamic_rope_below_max_positions_is_plain_rope():
    """transformers keeps dynamic NTK at the plain frequencies up to max_position_embeddings."""
    plain = Rotary(32, 128, 10000.0, None)
    dynamic = Rotary(32, 128, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
    assert torch.equal(plain.cos_sin, dynamic.cos_sin)


# -- config errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("field", REQUIRED)
def test_missing_field_names_the_file_and_field(field, tmp_path):
    cfg = dict(cf.PUBLISHED["qwen3-0.6b"])
    del cfg[field]
    folder = write_config(tmp_path, cfg)
    with pytest.raises(ValueError, match=rf"{re.escape(str(folder / 'config.json'))}.*missing.*'{field}'"):
        ModelConfig.from_path(folder)


def test_engine_reports_a_missing_field(tmp_path):
    folder = build_checkpoint(tmp_path, "qwen2", tokenizer=False)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["num_attention_heads"]
    write_config(folder, cfg)
    with pytest.raises(ValueError, match="missing.*'num_attention_heads'"):
        Engine(str(folder), dtype="float32", max_total_tokens=64)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "unsupported architecture 'GPT2LMHead"),
        (dict(architectures=[]), "no 'architectures' entry"),
        (dict(model_type="not-a-model"), "transformers cannot read this config"),
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads=3"),
    ],
)
def test_bad_configs_are_clear_errors(change, message, tmp_path):
    folder = write_config(tmp_path, dict(cf.PUBLISHED["qwen3-0.6b"], **change))
    with pytest.raises(ValueError, match=message) as err:
        ModelConfig.from_path(folder)
    assert str(folder / "config.json") in str(err.value)


def test_unreadable_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path / 'config.json'))}: not valid JSON"):
        ModelConfig.from_path(tmp_path)


def test_fields_transformers_defaults_are_read_as_transformers_reads_them(tmp_path):
    """A Mistral file without sliding_window gets transformers' default (4096), as the trainer's model
    does; a Qwen file's sliding_window counts only with use_sliding_window."""
    cfg = dict(cf.PUBLISHED["mistral-7b-v0.1"])
    del cfg["sliding_window"]
    assert ModelConfig.from_path(write_config(tmp_path / "m", cfg)).sliding_window == 4096
    qwen = dict(cf.PUBLISHED["qwen2.5-0.5b"], use_sliding_window=True, max_window_layers=0)
    assert ModelConfig.from_path(write_config(tmp_path / "q", qwen)).sliding_window == 32768
