"""Shared by the weight-sync tests: perturbed trainer models and checks against them.

A check proves the engine now runs the trainer's model: every weight read back equals the trainer's
tensor, and greedy tokens and their logprobs equal transformers' on the same weights.
"""

from __future__ import annotations

import torch
from helpers import PROMPTS, hf_greedy, hf_logprobs

from rollout import SamplingParams

# the CPU tests pin the CPU (float32), also on a GPU machine; GPU tests ask for cuda themselves
CPU = dict(device="cpu", page_size=4)
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=True)
CHECK_PROMPTS = [PROMPTS[0], PROMPTS[3]]
# HF names whose engine storage is fused or shared: read back through the fused/tied parameter
FUSED_NAMES = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.self_attn.v_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
]


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def perturb(model, seed: int):
    """Move every parameter by a few percent of its scale, so outputs change but stay peaked."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.device, p.dtype)
        p.add_(noise * 0.15 * p.detach().float().abs().mean().to(p.dtype))
    return model


def perturbed(path: str, seed: int):
    return perturb(load_hf(path), seed)


def hf_weight(model, name: str) -> torch.Tensor:
    if name == "lm_head.weight":
        return model.get_output_embeddings().weight.detach()
    return model.get_parameter(name).detach()


def all_names(model) -> list[str]:
    return [n for n, _ in model.named_parameters()] + ["lm_head.weight"]


def assert_weights_equal(engine, model, names: list[str] | None = None) -> None:
    for name in names or all_names(model):
        got, want = engine.get_weights_by_name(name), hf_weight(model, name).cpu()
        assert got.shape == want.shape, name
        assert torch.equal(got.to(want.dtype), want), f"{name} differs"


def outputs(engine, prompts=None) -> tuple[list[list[int]], list[list[float]]]:
    outs = engine.generate(input_ids=prompts or CHECK_PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def assert_runs_model(engine, model, tol: float = 1e-4) -> None:
    """The engine's greedy tokens and logprobs equal transformers' with the trainer's weights."""
    tokens, logprobs = outputs(engine)
    for prompt, toks, lps in zip(CHECK_PROMPTS, tokens, logprobs):
        assert toks == hf_greedy(model, prompt, len(toks))
        ref = hf_logprobs(model, prompt, toks)
        assert max(abs(a - b) for a, b in zip(lps, ref)) < tol


def snapshot(engine, model) -> dict[str, torch.Tensor]:
    return {n: engine.get_weights_by_name(n) for n in all_names(model)}


def assert_same_snapshot(engine, before: dict[str, torch.Tensor]) -> None:
    for name, t in before.items():
        assert torch.equal(engine.get_weights_by_name(name), t), f"{name} changed"


def state_list(model, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().to(dtype or p.dtype)) for n, p in model.named_parameters()]
