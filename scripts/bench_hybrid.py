"""GRPO-shaped generation throughput of a hybrid (linear-attention) model against transformers `generate`.

Workload: --prompts prompts of --prompt-len random tokens, n=--n samples each, --new tokens each,
temperature 1.0, logprobs, ignore_eos. The engine runs it whole (CUDA graphs on, the n samples of a
prompt sharing its prefill); transformers runs --hf-prompts of the prompts (num_return_sequences=n,
min_new_tokens=max_new_tokens, bf16, its own cache) in the same process first, and output tokens/s are
compared. transformers uses flash-linear-attention / causal-conv1d when installed, else its torch
fallbacks (as does the engine's prefill without fla; its decode uses its own Triton kernel).
The decode step against the bandwidth floor is scripts/bench_decode.py (the floor counts the state).

    python scripts/bench_hybrid.py --model qwen3.5-2b --json hybrid_2b.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import SHAPES, bench_model  # noqa: E402

from rollout import Engine, SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_throughput(folder: Path, prompts: list[list[int]], n: int, new: int, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    kw = dict(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=new, min_new_tokens=new)
    with torch.inference_mode():
        model.generate(
            ids[:1, :32], num_return_sequences=2, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4}
        )
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, num_return_sequences=n, **kw)
        sync()
    seconds = time.perf_counter() - t0
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    del model, out
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(prompts=len(prompts), seconds=seconds, output_tokens=tokens, tok_s=tokens / seconds)


def engine_throughput(folder: Path, prompts: list[list[int]], n: int, new: int, args) -> dict:
    engine = Engine(str(folder), device=args.device, max_running_requests=args.max_running, seed=0)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new, ignore_eos=True, logprobs=True)
    warm = SamplingParams(n=2, max_new_tokens=8, ignore_eos=True)
    engine.generate(input_ids=prompts[:4], sampling_params=warm, use_tqdm=False)
    engine.flush_cache()
    before = engine.stats.prefill_tokens
    sync()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert tokens == len(prompts) * n * new and all(len(c.logprobs) == new for o in outs for c in o.outputs)
    result = dict(
        prompts=len(prompts),
        seconds=seconds,
        output_tokens=tokens,
        tok_s=tokens / seconds,
        prefill_tokens=engine.stats.prefill_tokens - before,
        graph_steps=engine.runner.graph_steps,
        cuda_graphs=engine.runner.graphs is not None,
        state_GB=engine.state.nbytes / 1e9 if engine.state is not None else 0.0,
    )
    engine.shutdown()
    del engine
    gc.collect()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-2b", help=f"a checkpoint folder or one of {sorted(SHAPES)}")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--hf-prompts", type=int, default=4, help="prompts given to transformers generate")
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (numbers meaningless)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    folder = bench_model(args.model) if args.model in SHAPES else Path(args.model)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    hf = hf_throughput(folder, prompts[: args.hf_prompts], args.n, args.new, args.device)
    print(
        f"transformers generate: {hf['output_tokens']} tokens in {hf['seconds']:.1f}s "
        f"= {hf['tok_s']:.0f} tok/s"
    )
    ours = engine_throughput(folder, prompts, args.n, args.new, args)
    print(
        f"engine: {ours['output_tokens']} tokens in {ours['seconds']:.1f}s = {ours['tok_s']:.0f} tok/s "
        f"(prefill tokens {ours['prefill_tokens']}, graph steps {ours['graph_steps']}, "
        f"state pool {ours['state_GB']:.2f} GB); x transformers: {ours['tok_s'] / hf['tok_s']:.1f}"
    )
    info = dict(
        model=args.model,
        gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        date=time.strftime("%Y-%m-%d"),
        workload=dict(prompts=args.prompts, n=args.n, prompt_len=args.prompt_len, new=args.new),
        transformers=hf,
        engine=ours,
        ratio=ours["tok_s"] / hf["tok_s"],
    )
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
