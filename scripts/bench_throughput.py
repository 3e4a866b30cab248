"""Offline generation throughput on random checkpoints with real model shapes.

Workload 1 (the nano-vllm benchmark): 256 requests, input and output lengths drawn uniformly from
100-1024 (fixed seed), random prompt tokens, temperature 0.6, ignore_eos. Output tokens/s of the engine
beside transformers `generate` on a subset of the same requests in the same run, and the ratio.
transformers runs first (so the engine's KV pool does not crowd it out), in batches of requests sorted
by output length and left-padded; a batch generates its longest output, and only the tokens each
request asked for count ("useful" tokens/s; all generated tokens are printed too).

Workload 2 (GRPO-shaped): 128 prompts of 256 tokens, n=8, 512 new tokens, temperature 1.0, logprobs.
Tokens/s from a plain run, then the share of time in prefill, decode and sampling from a second run
that synchronises the device around each phase (its total is printed too; the prefix cache is flushed
between runs), and the ratio to the workload's decode floor: every decode step at the bandwidth floor
(weights + the KV bytes its batch reads, over the copy bandwidth measured in this run), the sequences
running in waves of at most --max-running. Prefill is left out of the floor, so the ratio errs high.

    python scripts/bench_throughput.py --model qwen2.5-0.5b --workload all --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import copy_bandwidth, kv_bytes, weight_bytes  # noqa: E402
from models import SHAPES, bench_model  # noqa: E402

import rollout.runner.model_runner as model_runner  # noqa: E402
from rollout import Engine, SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def workload1(vocab: int, seed: int, num: int, max_len: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    in_lens, out_lens = rng.integers(100, max_len + 1, num), rng.integers(100, max_len + 1, num)
    prompts = [rng.integers(0, vocab, n).tolist() for n in in_lens]
    return prompts, out_lens.tolist()


@torch.inference_mode()
def hf_generate(folder: Path, prompts, out_lens, batch: int, device: str) -> dict:
    """transformers generate over the requests, batched by output length, left padding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).to(device).eval()
    order = sorted(range(len(prompts)), key=lambda i: out_lens[i])
    generated = 0
    warm = torch.tensor([prompts[0][:16]], device=device)
    model.generate(warm, max_new_tokens=4, min_new_tokens=4, do_sample=True, pad_token_id=0)
    sync()
    t0 = time.perf_counter()
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        new = max(out_lens[i] for i in idx)
        model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            min_new_tokens=new,  # like ignore_eos: no request stops early
            do_sample=True,
            temperature=0.6,
            top_k=0,
            top_p=1.0,
            pad_token_id=0,
        )
        generated += new * len(idx)
    sync()
    seconds = time.perf_counter() - t0
    useful = sum(out_lens)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dict(
        requests=len(prompts),
        batch=batch,
        seconds=seconds,
        useful_tokens=useful,
        generated_tokens=generated,
        useful_tok_s=useful / seconds,
        generated_tok_s=generated / seconds,
    )


def warm_up(engine: Engine, vocab: int) -> None:
    """Compile kernels (JIT) and fill the allocator before timing."""
    prompts = [[i % vocab for i in range(1, 200)], [i % vocab for i in range(5, 40)]] * 4
    engine.generate(
        input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=16, ignore_eos=True), use_tqdm=False
    )
    engine.flush_cache()


class PhaseTimer:
    """Synchronised wall time of the forward pass (prefill or decode step) and of sampling; the rest of
    the loop (scheduling, batch preparation, postprocessing, copies to the host) is `host`."""

    def __init__(self, engine: Engine):
        self.seconds: dict[str, float] = defaultdict(float)
        runner = engine.runner
        forward, sample = runner.forward_logits, model_runner.sample

        def timed_forward(inputs):
            sync()
            t0 = time.perf_counter()
            out = forward(inputs)
            sync()
            self.seconds["decode" if inputs.attn.decode else "prefill"] += time.perf_counter() - t0
            return out

        def timed_sample(logits, sb):
            t0 = time.perf_counter()
            out = sample(logits, sb)
            sync()
            self.seconds["sampling"] += time.perf_counter() - t0
            return out

        runner.forward_logits = timed_forward
        model_runner.sample = timed_sample
        self._restore = lambda: (delattr(runner, "forward_logits"), setattr(model_runner, "sample", sample))

    def close(self) -> None:
        self._restore()


def run_workload1(engine: Engine, args, prompts, out_lens) -> dict:
    params = [SamplingParams(temperature=0.6, max_new_tokens=n, ignore_eos=True) for n in out_lens]
    sync()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(out_lens)
    return dict(
        requests=len(prompts),
        seconds=seconds,
        output_tokens=tokens,
        tok_s=tokens / seconds,
        prompt_tokens=sum(map(len, prompts)),
        stats=dict(engine.last_stats),
    )


def run_workload2(engine: Engine, vocab: int, seed: int, shape: list[int]) -> dict:
    num, n, prompt_len, new = shape
    rng = np.random.default_rng(seed + 1)
    prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(num)]
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new, ignore_eos=True, logprobs=True)
    result = {}
    for timed_phases in (False, True):
        engine.flush_cache()
        timer = PhaseTimer(engine) if timed_phases else None
        sync()
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
        sync()
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        assert tokens == num * n * new and all(len(c.logprobs) == new for o in outs for c in o.outputs)
        if timer is None:
            result.update(
                seconds=seconds, output_tokens=tokens, tok_s=tokens / seconds, stats=dict(engine.last_stats)
            )
            continue
        timer.close()
        phases = dict(timer.seconds)
        phases["host"] = seconds - sum(phases.values())
        result["timed_run_seconds"] = seconds
        result["share"] = {k: v / seconds for k, v in phases.items()}
        result["phase_seconds"] = phases
    result["floor_s"] = decode_floor(engine, num * n, prompt_len, new)
    result["x_floor"] = result["seconds"] / result["floor_s"]
    return result


def decode_floor(engine: Engine, seqs: int, prompt_len: int, new: int) -> float:
    """Seconds for `seqs` sequences to decode `new` tokens each at the bandwidth floor, in waves of at
    most max_running_requests: step t of a wave of B reads the weights once and B x (prompt + t) tokens
    of KV."""
    bandwidth = copy_bandwidth(engine.device)
    weights, per_token = weight_bytes(engine.model), kv_bytes(engine, 1, 1)
    waves = [engine.config.max_running_requests] * (seqs // engine.config.max_running_requests)
    if seqs % engine.config.max_running_requests:
        waves.append(seqs % engine.config.max_running_requests)
    kv_tokens = new * prompt_len + new * (new - 1) // 2  # sum over t < new of (prompt + t)
    return sum(new * weights + b * kv_tokens * per_token for b in waves) / bandwidth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b", help=f"a checkpoint folder or one of {sorted(SHAPES)}")
    ap.add_argument("--workload", choices=["1", "2", "all"], default="all")
    ap.add_argument(
        "--w1",
        type=int,
        nargs=2,
        default=[256, 1024],
        metavar=("REQUESTS", "MAX_LEN"),
        help="workload 1: requests, longest input/output (shortest is 100)",
    )
    ap.add_argument(
        "--w2",
        type=int,
        nargs=4,
        default=[128, 8, 256, 512],
        metavar=("PROMPTS", "N", "PROMPT_LEN", "NEW"),
        help="workload 2 shape",
    )
    ap.add_argument("--hf-requests", type=int, default=64, help="workload 1 requests given to transformers")
    ap.add_argument("--hf-batch", type=int, default=64, help="transformers generate batch size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--cuda-graph", type=int, default=1)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (numbers meaningless)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    folder = bench_model(args.model) if args.model in SHAPES else Path(args.model)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = {
        "model": args.model,
        "gpu": gpu,
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
    }
    prompts, out_lens = workload1(vocab, args.seed, *args.w1)
    if args.workload in ("1", "all") and args.hf_requests > 0:
        hf = hf_generate(
            folder, prompts[: args.hf_requests], out_lens[: args.hf_requests], args.hf_batch, args.device
        )
        results["hf"] = hf
        print(
            f"transformers generate: {hf['requests']} of the {len(prompts)} requests, batch {hf['batch']}, "
            f"sorted by output length, {hf['seconds']:.1f}s: {hf['useful_tok_s']:.0f} useful output tok/s "
            f"({hf['generated_tok_s']:.0f} tok/s counting each batch's padding to its longest output)"
        )
    engine = Engine(
        str(folder),
        device=args.device,
        attention_backend=args.backend,
        max_running_requests=args.max_running,
        cuda_graph=bool(args.cuda_graph),
    )
    graphs = engine.runner.graphs
    results.update(
        backend=engine.backend_name,
        kv_pool_tokens=engine.pool_tokens,
        graph_capture_s=graphs.capture_seconds if graphs else None,
        graph_memory_MiB=graphs.memory_bytes / 2**20 if graphs else None,
    )
    print(
        f"engine: {gpu}, {args.model}, backend {engine.backend_name}, KV pool {engine.pool_tokens} tokens, "
        f"graphs {'on' if graphs else 'off'}"
    )
    warm_up(engine, vocab)
    if args.workload in ("1", "all"):
        w1 = run_workload1(engine, args, prompts, out_lens)
        results["workload1"] = w1
        print(
            f"workload 1: {w1['requests']} requests, {w1['prompt_tokens']} prompt + "
            f"{w1['output_tokens']} output tokens in {w1['seconds']:.2f}s: {w1['tok_s']:.0f} output tok/s"
        )
        if "hf" in results:
            ratio = w1["tok_s"] / results["hf"]["useful_tok_s"]
            w1["ratio_vs_hf_useful"] = ratio
            w1["ratio_vs_hf_generated"] = w1["tok_s"] / results["hf"]["generated_tok_s"]
            print(
                f"  {ratio:.1f}x transformers generate (useful tokens; "
                f"{w1['ratio_vs_hf_generated']:.1f}x against all its generated tokens)"
            )
    if args.workload in ("2", "all"):
        w2 = run_workload2(engine, vocab, args.seed, args.w2)
        results["workload2"] = w2
        share = ", ".join(f"{k} {100 * v:.1f}%" for k, v in w2["share"].items())
        num, n, plen, new = args.w2
        print(
            f"workload 2: {num} prompts of {plen} tokens x {n} samples x {new} tokens in "
            f"{w2['seconds']:.2f}s: {w2['tok_s']:.0f} output tok/s; time share "
            f"({w2['timed_run_seconds']:.2f}s synchronised run): {share}; decode floor "
            f"{w2['floor_s']:.2f}s, {w2['x_floor']:.2f}x it"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
