"""Qwen3.5 and Qwen3-Next in a 2-rank tensor-parallel group (gloo on the CPU), float32: the gated
attention splits its heads, the Gated DeltaNet its key and value heads (q, k, v, z, b, a, the conv and the
per-request state alike); tokens and logprobs equal one rank's and transformers', with and without a LoRA
adapter on every linear layer; head counts that do not split are refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from dist_cluster import Cluster
from helpers import PROMPTS, hf_logprobs
from test_lora import adapter, peft_model
from test_qwen35 import build_checkpoint
from test_qwen35_lora import undo_moe_targets
from test_tensor_parallel import assert_same, summary

from rollout import Engine, SamplingParams
from rollout.models.toy import tiny_config

ARCHS = ["qwen3_5", "qwen3_next"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2)
SAMPLED = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, ignore_eos=True, logprobs=True, seed=7)
ENGINE = dict(
    dtype="float32",
    attention_backend="torch",
    page_size=4,
    max_total_tokens=1024,
    max_loras=1,
    max_lora_rank=8,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(2, tmp_path_factory.mktemp("hybrid-dist"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """The tiny configs split: 4 heads, 2 KV heads, 2 linear key heads, 4 linear value heads."""
    root = tmp_path_factory.mktemp("hybrid-tp")
    made = {arch: build_checkpoint(root / arch, arch, seed=3) for arch in ARCHS}
    for name, heads in [("kv1", dict(num_key_value_heads=1)), ("linear-k1", dict(linear_num_key_heads=1))]:
        made[name] = root / name  # refused while the model is built: a config is enough
        cfg = tiny_config("qwen3_5", **heads, linear_num_value_heads=2)
        cfg.architectures = ["Qwen3_5ForCausalLM"]
        cfg.save_pretrained(made[name])
    return {name: str(path) for name, path in made.items()}


def run(engine: Engine, lora: str | None = None) -> list:
    """Greedy and n=2 sampled outputs on the base model; greedy ones on an adapter."""
    params = [replace(GREEDY, lora_name=lora)] if lora else [GREEDY, SAMPLED]
    return [x for p in params for x in summary(engine.generate(input_ids=PROMPTS, sampling_params=p))]


# -- on every rank (module-level so the workers can import them) -----------------------------------------
def rank_tp_generate(path: str, tensors: dict, config: dict):
    engine = Engine(path, tp_size=2, **ENGINE)
    assert engine.tp.size == 2
    assert engine.state.tensors["recurrent"].shape[2] == 2  # this rank's 2 of the 4 linear value heads
    engine.load_lora_adapter_from_tensors("a", tensors, config)
    return run(engine), run(engine, "a")


def rank_bad_heads(paths: list[str]):
    errors = []
    for path in paths:
        try:
            Engine(path, tp_size=2, **ENGINE)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


# -- tests -------------------------------------------------------------------------------------------------
@pytest.mark.slow  # the first call waits for both ranks to import the engine and transformers
@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_matches_one_rank_and_transformers(arch, cluster, ckpts):
    from transformers import AutoModelForCausalLM

    path = ckpts[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tensors, config = adapter(peft_model(hf, "all-linear", 8, seed=4))
    undo_moe_targets(config)  # Qwen3-Next: see there (a no-op for Qwen3.5)
    one = Engine(path, **ENGINE)
    one.load_lora_adapter_from_tensors("a", tensors, config)
    ref, ref_lora = run(one), run(one, "a")
    assert [t for t, _, _ in ref] != [t for t, _, _ in ref_lora]  # the adapter matters
    for prompt, (tokens, logprobs, _) in zip(PROMPTS, ref):  # the greedy ones: one rank is transformers
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        assert tokens == logits.argmax(-1).tolist()
        torch.testing.assert_close(logprobs, hf_logprobs(hf, prompt, tokens), atol=1e-4, rtol=0)
    (base0, lora0), (base1, lora1) = cluster.values(rank_tp_generate, path, tensors, config, timeout=300.0)
    assert (base0, lora0) == (base1, lora1)  # every rank of the group gets the same outputs
    assert_same(base0, ref)
    assert_same(lora0, ref_lora)


def test_heads_that_do_not_split_are_refused_by_name(cluster, ckpts):
    for errors in cluster.values(rank_bad_heads, [ckpts["kv1"], ckpts["linear-k1"]], timeout=60.0):
        assert errors == [
            "tp_size=2 does not divide num_key_value_heads=1",
            "tp_size=2 does not divide linear_num_key_heads=1",
        ]
