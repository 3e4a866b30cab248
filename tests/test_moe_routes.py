"""Routed experts (R3): the engine reports, for every token, the experts each MoE layer chose, and a
transformers trainer replays them (integrations/routing_replay.py). CPU, float32, tiny Qwen3-MoE."""

from __future__ import annotations

import pytest
import torch
from helpers import router_top_k
from weights_helpers import load_hf

from integrations.routing_replay import RouteRecorder, RoutingReplay, pad_routes, route_mismatch
from rollout import Engine, SamplingParams
from rollout.models.toy import build_checkpoint

PROMPT = list(range(3, 40))
SAMPLE = SamplingParams(
    temperature=1.0,
    n=8,
    max_new_tokens=12,
    ignore_eos=True,
    logprobs=True,
    return_routed_experts=True,
    seed=1,
)


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory) -> str:
    # 3 layers, layer 1 dense: 2 MoE layers of 8 experts, top-2
    root = tmp_path_factory.mktemp("moe_routes")
    return str(
        build_checkpoint(root / "q3moe", "qwen3_moe", seed=11, num_hidden_layers=3, mlp_only_layers=[1])
    )


@pytest.fixture(scope="session")
def hf(moe_dir):
    return load_hf(moe_dir)


def engine_for(path: str, **kw) -> Engine:
    options = dict(device="cpu", page_size=4, enable_return_routed_experts=True, max_total_tokens=512)
    return Engine(path, **{**options, **kw})


def trainer_routes(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' own router top-k for tokens[:-1] (each token the engine ran forward), exact ties
    resolved as the engine resolves them."""
    with torch.no_grad(), router_top_k(hf) as got:
        hf(torch.tensor([tokens[:-1]]))
    return got[0]


def assert_routes_match(hf, outs) -> int:
    checked = 0
    for o in outs:
        for c in o.outputs:
            tokens = o.prompt_token_ids + c.token_ids
            r = c.routed_experts
            assert r.dtype == torch.int32 and r.shape == (len(tokens) - 1, 2, 2)
            assert route_mismatch(r, trainer_routes(hf, tokens), torch.ones(len(tokens) - 1)) == 0
            checked += 1
    return checked


def test_asking_without_the_store_is_a_clear_error(moe_dir, checkpoints):
    engine = Engine(moe_dir, device="cpu", max_total_tokens=256)
    with pytest.raises(ValueError, match="enable_return_routed_experts=True"):
        engine.generate(input_ids=[PROMPT], sampling_params=SamplingParams(return_routed_experts=True))
    assert engine.generate(
        input_ids=[PROMPT], sampling_params=SamplingParams(max_new_tokens=2)
    )  # still usable
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        Engine(checkpoints["qwen3"], device="cpu", enable_return_routed_experts=True)


def test_routes_equal_transformers_top_k_with_chunks_prefix_sharing_and_n8(moe_dir, hf):
    # chunked prefill (16-token chunks), 8 samples sharing each prompt's pages, and a second prompt
    # whose first 20 tokens hit the first one's cached pages
    engine = engine_for(moe_dir, max_prefill_tokens=16)
    outs = engine.generate(input_ids=[PROMPT, PROMPT[:20] + [5, 6]], sampling_params=SAMPLE, use_tqdm=False)
    assert assert_routes_match(hf, outs) == 16
    plain = engine.generate(input_ids=[PROMPT], sampling_params=SamplingParams(max_new_tokens=2))
    assert plain[0].outputs[0].routed_experts is None  # only for requests that ask


def test_routes_survive_preemption(moe_dir, hf):
    engine = engine_for(moe_dir, max_total_tokens=96, max_running_requests=8)
    params = SamplingParams(
        temperature=1.0, n=4, max_new_tokens=24, ignore_eos=True, return_routed_experts=True, seed=2
    )
    outs = engine.generate(input_ids=[PROMPT[:14], PROMPT[10:26]], sampling_params=params, use_tqdm=False)
    assert engine.stats.preemptions > 0
    assert assert_routes_match(hf, outs) == 8


def test_score_returns_routes(moe_dir, hf):
    engine = engine_for(moe_dir)
    tokens = PROMPT + [7, 8, 9]
    out = engine.score(input_ids=[tokens])[0]
    assert torch.equal(out.routed_experts.sort(-1).values, trainer_routes(hf, tokens).sort(-1).values)


def test_replay_gives_the_engine_logprobs_and_removes_the_route_gap(moe_dir, hf):
    engine = engine_for(moe_dir)
    outs = engine.generate(input_ids=[PROMPT, PROMPT[5:30]], sampling_params=SAMPLE, use_tqdm=False)
    samples = [(o.prompt_token_ids, c) for o in outs for c in o.outputs]
    seq_len = max(len(p) + len(c.token_ids) for p, c in samples)
    ids = torch.zeros(len(samples), seq_len, dtype=torch.long)
    mask = torch.zeros(len(samples), seq_len, dtype=torch.bool)  # completion tokens (right-padded batch)
    engine_lp = torch.zeros(len(samples), seq_len, dtype=torch.float64)
    for i, (p, c) in enumerate(samples):
        tokens = p + c.token_ids
        ids[i, : len(tokens)] = torch.tensor(tokens)
        mask[i, len(p) : len(tokens)] = True
        engine_lp[i, len(p) : len(tokens)] = torch.tensor(c.logprobs, dtype=torch.float64)
    routes = pad_routes([c.routed_experts for _, c in samples], seq_len)
    lengths = torch.tensor([len(p) + len(c.token_ids) for p, c in samples])
    attn = torch.arange(seq_len)[None, :] < lengths[:, None]

    def logprobs(model, replay: bool) -> torch.Tensor:
        rr = RoutingReplay(model)
        try:
            ctx = rr.use(routes) if replay else torch.no_grad()
            with torch.no_grad(), ctx:
                logits = model(ids, attention_mask=attn.long()).logits.double()
        finally:
            rr.remove()
        lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        return torch.nn.functional.pad(lp, (1, 0))

    gap = ((logprobs(hf, replay=True) - engine_lp).abs() * mask).max().item()
    assert gap <= 1e-5, gap
    # a perturbed router (the trainer's weights a step later, or another kernel's rounding): its own
    # routes differ from the engine's; replaying the engine's routes keeps the top-k sets and only
    # the gate weights move, so the logprob gap shrinks
    perturbed = load_hf(moe_dir)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for gate in RoutingReplay(perturbed).gates:
            gate.weight.add_(torch.randn(gate.weight.shape, generator=g) * 0.1 * gate.weight.abs().mean())
    with torch.no_grad(), RouteRecorder(perturbed).record() as own:
        perturbed(ids, attention_mask=attn.long())
    own_routes = own[0].view(len(samples), seq_len, 2, 2)
    valid = torch.arange(seq_len)[None, :] < lengths[:, None] - 1  # rows the engine has routes for
    assert route_mismatch(routes, own_routes, valid) > 0.05
    off = ((logprobs(perturbed, replay=False) - engine_lp).abs() * mask).max().item()
    on = ((logprobs(perturbed, replay=True) - engine_lp).abs() * mask).max().item()
    print(f"perturbed router: route mismatch {route_mismatch(routes, own_routes, valid):.2f}, "
          f"logprob gap {off:.2e} without replay, {on:.2e} with")  # fmt: skip
    assert on < off / 2


def test_replay_keeps_router_gradients(moe_dir):
    model = load_hf(moe_dir)
    ids = torch.tensor([PROMPT])
    with torch.no_grad(), RouteRecorder(model).record() as own:
        model(ids)
    replay = RoutingReplay(model)
    with replay.use(own[0].view(1, len(PROMPT), 2, 2)):
        model(ids).logits.logsumexp(-1).mean().backward()
    assert all(g.weight.grad is not None and g.weight.grad.abs().sum() > 0 for g in replay.gates)
    with pytest.raises(ValueError, match="routes must be"):
        with replay.use(torch.zeros(1, len(PROMPT), 3, 2, dtype=torch.long)):
            pass


def decode_routes(b64: str, seq_len: int) -> torch.Tensor:
    import base64

    import numpy as np

    raw = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    return torch.from_numpy(raw.copy()).view(seq_len - 1, 2, 2)  # [seq_len - 1, L, K]


def test_sglang_front_sends_routes_as_base64_int32(moe_dir, hf):
    from rollout.compat.sglang import Engine as SGLangEngine

    engine = SGLangEngine(moe_dir, device="cpu", page_size=4, enable_return_routed_experts=True)
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    out = engine.generate(input_ids=PROMPT, sampling_params=params, return_routed_experts=True)
    seq = PROMPT + out["output_ids"]
    routes = decode_routes(out["meta_info"]["routed_experts"], len(seq))  # as slime reads them
    assert route_mismatch(routes, trainer_routes(hf, seq), torch.ones(len(seq) - 1)) == 0
    streamed = list(engine.generate(input_ids=PROMPT, sampling_params=params, return_routed_experts=True,
                                    stream=True))  # fmt: skip
    assert streamed[-1]["meta_info"]["routed_experts"] == out["meta_info"]["routed_experts"]
    assert "routed_experts" not in engine.generate(input_ids=PROMPT, sampling_params=params)["meta_info"]


def test_http_generate_streams_routes_whole_with_the_last_chunk(moe_dir, hf):
    """As SGLang (which reads a request's routes when it finishes): the streamed chunks before the last
    carry no routes, the last carries all of them, equal to the non-streamed answer's."""
    import json
    import threading
    import time

    import httpx
    import uvicorn
    from serve_proc import free_port

    from rollout import AsyncEngine
    from rollout.serve import build_app

    engine = AsyncEngine(
        moe_dir, device="cpu", page_size=4, max_total_tokens=512, enable_return_routed_experts=True
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, model_name="moe"), port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "return_routed_experts": True,
        }
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            whole = client.post("/generate", json=body).json()
            with client.stream("POST", "/generate", json=body | {"stream": True}) as s:
                events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    seq = PROMPT + whole["output_ids"]
    routes = decode_routes(whole["meta_info"]["routed_experts"], len(seq))
    assert route_mismatch(routes, trainer_routes(hf, seq), torch.ones(len(seq) - 1)) == 0
    assert len(events) > 1 and events[-1]["output_ids"] == whole["output_ids"]
    assert all("routed_experts" not in e["meta_info"] for e in events[:-1])
    assert events[-1]["meta_info"]["routed_experts"] == whole["meta_info"]["routed_experts"]


def test_joined_stream_deltas_keep_the_last_deltas_routes():
    """A caller behind the step loop gets queued deltas joined into one: the routes on the last must
    survive the join (the process-backed front joins its final output with pending token deltas)."""
    from rollout.fronts.stream_deltas import merge
    from rollout.outputs import CompletionOutput, RequestOutput

    routes = torch.arange(8, dtype=torch.int32).view(2, 2, 2)
    first = CompletionOutput(0, [5], "", None, None, None, weight_versions=[0])
    last = CompletionOutput(0, [6], "", None, None, "length", weight_versions=[0], routed_experts=routes)
    outs = [RequestOutput([4], [c], request_id="r") for c in (first, last)]
    joined = merge(outs).outputs[0]
    assert joined.token_ids == [5, 6] and joined.routed_experts is routes


def test_vllm_front_gives_routes_on_each_completion(moe_dir, hf):
    from rollout.compat.vllm import LLM
    from rollout.compat.vllm import SamplingParams as VllmParams

    llm = LLM(moe_dir, device="cpu", block_size=4, enable_return_routed_experts=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}], VllmParams(n=2, max_tokens=4, seed=3))
    for c in outs[0].outputs:
        seq = PROMPT + c.token_ids
        routes = torch.from_numpy(c.routed_experts)
        assert route_mismatch(routes, trainer_routes(hf, seq), torch.ones(len(seq) - 1)) == 0


@pytest.mark.slow
def test_grpo_with_routing_replay_learns_on_a_tiny_moe(tmp_path):
    """examples/grpo.py --routing-replay on a tiny Qwen3-MoE (2 MoE layers, 8 experts, top-2): the
    reward of the repeat task climbs, and the engine-trainer gap stays float32 noise."""
    from test_rl_parts import load_example

    folder = build_checkpoint(tmp_path / "moe", "qwen3_moe", seed=0)
    grpo = load_example("grpo")
    cfg = grpo.Config(model=str(folder), steps=20, batch=8, n=8, minibatches=1, seed=0, device="cpu",
                      progress=False, routing_replay=True)  # fmt: skip
    history = grpo.train(cfg)
    rewards = [h["reward/mean"] for h in history]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, [round(r, 3) for r in rewards]
    assert max(h["logprob_gap/max"] for h in history) < 1e-3
    assert all("routes/differ" not in h for h in history)  # replayed: nothing to report


@pytest.mark.gpu
def test_gpu_cuda_graph_decode_matches_transformers_with_routes(moe_dir, hf):
    """Float32 on CUDA: the fused Triton experts, decode steps replayed from CUDA graphs (19 sequences
    pad to a captured size of 24: padding rows get no expert work), routes and logprobs against the CPU
    transformers model."""
    engine = Engine(moe_dir, device="cuda", dtype="float32", page_size=16, enable_return_routed_experts=True)
    prompts = [PROMPT, PROMPT[4:30], PROMPT[:9]]
    params = SamplingParams(
        temperature=1.0,
        n=6,
        max_new_tokens=12,
        ignore_eos=True,
        logprobs=True,
        return_routed_experts=True,
        seed=3,
    )
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=True,
                            return_routed_experts=True)  # fmt: skip
    outs = engine.generate(input_ids=prompts, sampling_params=[params, params, greedy])
    assert engine.stats.graph_steps > 0
    assert assert_routes_match(hf, outs) == 13
    for o in outs:
        for c in o.outputs:
            tokens = o.prompt_token_ids + c.token_ids
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, :-1].double(), -1)
            want = lp[len(o.prompt_token_ids) - 1 :].gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert (torch.tensor(c.logprobs, dtype=torch.float64) - want).abs().max() < 1e-4
