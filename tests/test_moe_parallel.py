"""MoE models in a 2-rank tensor-parallel group (gloo on the CPU): each expert is split along its
intermediate dim (the shared expert too), the router replicated; outputs equal one rank's, and a
transformers 5 update (fused experts) loads and reads back whole."""

from __future__ import annotations

import pytest
import torch
from dist_cluster import Cluster
from helpers import PROMPTS
from weights_helpers import load_hf, perturb

from rollout import Engine, SamplingParams
from rollout.models.toy import build_checkpoint

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=True)
SAMPLED = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, ignore_eos=True, logprobs=True, seed=7)
ENGINE = dict(page_size=4, max_total_tokens=1024, enable_return_routed_experts=True)
ROUTED = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True, return_routed_experts=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(2, tmp_path_factory.mktemp("moe-dist"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory) -> str:
    # Qwen2-MoE: a shared expert (48 wide) beside 8 experts of 32, all split over the 2 ranks
    return str(build_checkpoint(tmp_path_factory.mktemp("moe-tp") / "q2moe", "qwen2_moe", seed=21))


def run(engine: Engine) -> list:
    outs = [engine.generate(input_ids=PROMPTS, sampling_params=p) for p in (GREEDY, SAMPLED)]
    routes = engine.generate(input_ids=PROMPTS[:2], sampling_params=ROUTED)
    return [(c.token_ids, c.logprobs) for o in outs for r in o for c in r.outputs] + [
        r.outputs[0].routed_experts.tolist() for r in routes
    ]


def trainer_state(path: str) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in perturb(load_hf(path), seed=9).named_parameters()]


def rank_tp_moe(path: str) -> tuple[list, list]:
    engine = Engine(path, tp_size=2, **ENGINE)
    before = run(engine)
    named = trainer_state(path)  # transformers 5 names: fused experts
    engine.update_weights_from_tensor(named)
    for name, full in named:  # reads gather the shards back into the full tensor
        assert torch.equal(engine.get_weights_by_name(name), full), name
    return before, run(engine)


def test_tp2_moe_matches_one_rank_before_and_after_a_fused_update(cluster, moe_ckpt):
    engine = Engine(moe_ckpt, **ENGINE)
    ref_before = run(engine)
    engine.update_weights_from_tensor(trainer_state(moe_ckpt))
    ref_after = run(engine)
    rank0, rank1 = cluster.values(rank_tp_moe, moe_ckpt, timeout=600.0)
    assert rank0 == rank1
    for ours, ref in zip(rank0, (ref_before, ref_after)):
        assert len(ours) == len(ref)
        for a, b in zip(ours, ref):
            if isinstance(a, tuple):
                assert a[0] == b[0]
                torch.testing.assert_close(a[1], b[1], atol=2e-5, rtol=0)
            else:
                assert a == b  # the routes: the router is replicated, so every rank picks the same
