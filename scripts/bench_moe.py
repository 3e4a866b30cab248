"""Qwen3-30B-A3B on one GPU: decode step against the floor, GRPO-shaped throughput against transformers,
the cost of routed experts (R3), and weight sync against the copy floor. Random bfloat16 weights made on
the device (48 layers, ~61 GB; no checkpoint is written: the engine's checkpoint load is replaced by a
random fill), so an 80 GB H100 holds the engine with a small KV pool.

    python scripts/bench_moe.py                       # the whole round (budget: under 8 minutes)
    python scripts/bench_moe.py --layers 4 --skip-hf  # quicker, smaller

  decode   Engine.step in steady decode at batch 1/64/256 (--context tokens each) against the floor:
           (attention/dense weights + the experts the step hits + KV bytes) / copy bandwidth. Experts
           hit per MoE layer are counted from the step's routes (the engine's route store).
  grpo     64 prompts x n=8 (--prompt-len, --new-tokens), tokens/s of Engine.generate, against
           transformers generate in its fastest experts implementation (grouped_mm or eager, timed on
           a short run first; batched_mm copies weights per token and does not fit), in the same run
  r3       the grpo run again with enable_return_routed_experts and every request asking for routes
  sync     update_weights_from_tensor of every weight in transformers 5's layout (fused experts),
           one layer's tensors at a time, against bytes / copy bandwidth
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_fidelity import PUBLISHED  # noqa: E402

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.models.toy import build_tokenizer  # noqa: E402

GB = 1e9


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Bytes moved per second (read + write) by a large device-to-device copy."""
    if device.type != "cuda":
        nbytes, reps = 64 << 20, 3
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync()
    return 2 * nbytes * reps / (time.perf_counter() - t)


@torch.no_grad()
def fill_random(params, seed: int = 0) -> None:
    """Init-scale normal weights (norms near 1): peaked enough that routing is not uniform noise."""
    g = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for name, p in params:
        if "norm" in name:
            p.uniform_(0.8, 1.2, generator=g)
        else:
            p.normal_(0.0, 0.02, generator=g)


def folder(layers: int) -> Path:
    cfg = dict(PUBLISHED["qwen3-30b-a3b"], num_hidden_layers=layers)
    out = Path(tempfile.mkdtemp(prefix="bench_moe_"))
    (out / "config.json").write_text(json.dumps(cfg))
    build_tokenizer(out)
    return out


def make_engine(path: Path, **options) -> Engine:
    """An Engine whose checkpoint load is a random fill on the device (the bench writes no 61 GB file)."""
    engine_module = sys.modules[Engine.__module__]
    real = engine_module.load_checkpoint

    def fill(model, path, **kw) -> int:
        fill_random(list(model.named_parameters()))
        return 0

    engine_module.load_checkpoint = fill
    try:
        return Engine(str(path), dtype="bfloat16", **options)
    finally:
        engine_module.load_checkpoint = real


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, vocab - 1000, (n, length), generator=g).tolist()


# -- decode ------------------------------------------------------------------------------------------
def dense_bytes(engine: Engine) -> int:
    """Bytes of every parameter a decode step reads in full: all but the routed experts (the
    embedding is gathered, not read; the LM head is)."""
    total = 0
    for name, p in engine.model.named_parameters():
        if ".experts." in name or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        if "embed_tokens" in name and not engine.model_config.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size()
    return total


def decode_rows(engine: Engine, batch: int, context: int, steps: int, seed: int) -> dict:
    mc = engine.model_config
    params = SamplingParams(temperature=1.0, max_new_tokens=steps + 64, ignore_eos=True, seed=seed)
    for i, p in enumerate(prompts(batch, context, mc.vocab_size, seed)):
        engine.add_request(f"d{batch}-{i}", p, params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed < s.num_prompt for s in sched.running):  # until all decode
        engine.step()
    for _ in range(3):
        engine.step()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    step_s = (time.perf_counter() - t) / steps
    # the experts the batch's last computed tokens hit, per MoE layer, from the route store
    seqs = list(engine.scheduler.running)
    size = engine.kv.page_size
    slots = [s.pages[(s.num_computed - 1) // size] * size + (s.num_computed - 1) % size for s in seqs]
    routes = engine.routes.table[torch.tensor(slots, device=engine.routes.table.device)].long()
    hit = sum(len(torch.unique(routes[:, layer])) for layer in range(routes.shape[1]))
    expert_bytes = 3 * mc.moe.intermediate_size * mc.hidden_size * 2
    kv = batch * (context + steps) * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 2
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    engine.step()
    return dict(step_s=step_s, experts_hit=hit, floor_bytes=dense_bytes(engine) + hit * expert_bytes + kv)


# -- throughput --------------------------------------------------------------------------------------
def engine_generate(engine: Engine, ps: list[list[int]], n: int, new_tokens: int, routes: bool) -> float:
    params = SamplingParams(
        temperature=1.0, n=n, max_new_tokens=new_tokens, ignore_eos=True, logprobs=True, seed=0,
        return_routed_experts=routes,
    )  # fmt: skip
    engine.generate(input_ids=ps[:2], sampling_params=params, use_tqdm=False)  # warm-up
    sync()
    t = time.perf_counter()
    outs = engine.generate(input_ids=ps, sampling_params=params, use_tqdm=False)
    sync()
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    if routes:
        assert all(c.routed_experts is not None for o in outs for c in o.outputs)
    return tokens / (time.perf_counter() - t)


def hf_generate(
    path: Path, ps: list[list[int]], n: int, new_tokens: int, rows: int, device: torch.device
) -> dict:
    """transformers generate on `rows` of the prompts x n (its KV for all 512 beside 61 GB of weights
    does not fit an 80 GB card); tokens/s of that batch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device=device).eval()
    fill_random(list(model.named_parameters()))
    ids = torch.tensor([p for p in ps for _ in range(n)], device=device)

    def run(impl: str, tokens: int, rows: int) -> float:
        model.set_experts_implementation(impl)
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            batch = ids[:rows]
            model.generate(
                batch, attention_mask=torch.ones_like(batch), pad_token_id=0,
                max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True,
            )  # fmt: skip
        sync()
        return rows * tokens / (time.perf_counter() - t)

    # batched_mm gathers a weight copy per (token, expert): out of memory at these widths
    quick = {}
    for impl in ("grouped_mm", "eager"):
        try:
            quick[impl] = run(impl, 8, min(len(ids), 64))
        except (RuntimeError, ValueError) as e:  # not available in this torch, or out of memory
            print(f"transformers experts_implementation={impl}: {type(e).__name__}: {str(e)[:200]}")
            torch.cuda.empty_cache() if device.type == "cuda" else None
    if not quick:
        raise RuntimeError("transformers generate failed in every experts implementation (see above)")
    best = max(quick, key=quick.get)
    return dict(impl=best, quick=quick, tokens_per_s=run(best, new_tokens, min(rows, len(ids))))


# -- weight sync -------------------------------------------------------------------------------------
def weight_sync(engine: Engine, bandwidth: float) -> dict:
    """Every weight, as a transformers 5 trainer names and shapes them, one layer at a time (the same
    source tensors for every layer: the shapes repeat)."""
    mc, dev = engine.model_config, engine.device
    E, H, I = mc.moe.num_experts, mc.hidden_size, mc.moe.intermediate_size  # noqa: E741
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    shapes = {
        "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
        "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q),
        "self_attn.q_norm.weight": (mc.head_dim,), "self_attn.k_norm.weight": (mc.head_dim,),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "mlp.gate.weight": (E, H), "mlp.experts.gate_up_proj": (E, 2 * I, H),
        "mlp.experts.down_proj": (E, H, I),
    }  # fmt: skip
    src = {k: torch.randn(s, device=dev, dtype=torch.bfloat16) * 0.02 for k, s in shapes.items()}
    for k in src:
        if "norm" in k:
            src[k] = src[k].abs() + 1
    updates = [[(f"model.layers.{i}.{k}", t) for k, t in src.items()] for i in range(mc.num_layers)]
    engine.update_weights_from_tensor(updates[0])  # builds the copy plan for this signature
    sync()
    t = time.perf_counter()
    for named in updates:
        engine.update_weights_from_tensor(named)
    sync()
    seconds = time.perf_counter() - t
    nbytes = sum(t.numel() * t.element_size() for named in updates for _, t in named)
    return dict(seconds=seconds, gbytes=nbytes / GB, floor_s=2 * nbytes / bandwidth)


def release(engine: Engine) -> None:
    """Give the engine's device memory back before the next 61 GB model is made."""
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"after release: {torch.cuda.memory_allocated() / GB:.1f} GB allocated", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    # ~9.8 GB of KV (98 KB a token): 61 GB of weights leave ~15 GB of an 80 GB card
    ap.add_argument("--max-total-tokens", type=int, default=100_000)
    ap.add_argument("--hf-rows", type=int, default=256, help="sequences transformers generates at once")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = folder(args.layers)
    bw = copy_bandwidth(device)
    print(f"copy bandwidth {bw / GB:.0f} GB/s; Qwen3-30B-A3B shape, {args.layers} layers, bf16", flush=True)
    options = dict(
        device=str(device), max_total_tokens=args.max_total_tokens,
        max_running_requests=max(max(args.batch_sizes), args.prompts * args.n),
    )  # fmt: skip
    results: dict = {"copy_gbps": bw / GB}
    ps = prompts(args.prompts, args.prompt_len, PUBLISHED["qwen3-30b-a3b"]["vocab_size"], seed=1)

    engine = make_engine(path, enable_return_routed_experts=True, **options)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    print(f"weights {weights / GB:.1f} GB, KV pool {engine.kv.nbytes / GB:.1f} GB, "
          f"route store {engine.routes.nbytes / GB:.2f} GB", flush=True)  # fmt: skip
    for b in args.batch_sizes:
        r = decode_rows(engine, b, args.context, args.decode_steps, seed=b)
        floor = r["floor_bytes"] / bw
        results[f"decode_bs{b}"] = dict(r, floor_s=floor, ratio=r["step_s"] / floor)
        print(f"decode bs={b:4d}: {r['step_s'] * 1e3:7.2f} ms/step, floor {floor * 1e3:6.2f} ms "
              f"({r['experts_hit']} experts hit over the MoE layers), ratio {r['step_s'] / floor:.2f}x",
              flush=True)  # fmt: skip
    with_routes = engine_generate(engine, ps, args.n, args.new_tokens, routes=True)
    print(f"grpo {args.prompts}x{args.n}, {args.prompt_len}+{args.new_tokens} tokens, routes on: "
          f"{with_routes:,.0f} tok/s", flush=True)  # fmt: skip
    s = weight_sync(engine, bw)
    results["sync"] = s
    print(f"weight sync {s['gbytes']:.1f} GB in {s['seconds']:.2f}s, copy floor {s['floor_s']:.2f}s, "
          f"ratio {s['seconds'] / s['floor_s']:.2f}x", flush=True)  # fmt: skip
    release(engine)

    engine = make_engine(path, **options)
    without = engine_generate(engine, ps, args.n, args.new_tokens, routes=False)
    results["grpo"] = dict(
        engine_tok_s=without, engine_r3_tok_s=with_routes, r3_cost=1 - with_routes / without
    )
    print(
        f"grpo routes off: {without:,.0f} tok/s; R3 costs {100 * (1 - with_routes / without):.1f}%",
        flush=True,
    )
    release(engine)

    if not args.skip_hf:
        hf = hf_generate(path, ps, args.n, args.new_tokens, args.hf_rows, device)
        results["grpo"].update(
            hf_tok_s=hf["tokens_per_s"], hf_impl=hf["impl"], speedup=without / hf["tokens_per_s"]
        )
        print(f"transformers generate ({hf['impl']}; quick {hf['quick']}): {hf['tokens_per_s']:,.0f} tok/s; "
              f"engine {without / hf['tokens_per_s']:.1f}x", flush=True)  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
