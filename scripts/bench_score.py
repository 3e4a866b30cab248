"""Engine.score throughput against the compute floor and a transformers forward of the same batch.

N sequences of `--prompt` + `--completion` tokens: G groups of `--group` completions sharing a prompt
(GRPO), scored from the completion on. Reported:

  score        tokens scored per second (prompt + completion tokens of every sequence / wall time)
  computed     tokens the engine prefilled (shared prompts counted once) and their rate
  floor        2 x params x computed tokens / peak bf16 FLOP/s, the peak measured in this run by a
               large bf16 matmul (attention FLOPs left out, so the floor is optimistic)
  hf           a transformers forward + log_softmax gather of the same sequences in micro-batches

    python scripts/bench_score.py --model qwen2.5-0.5b --sequences 256 --prompt 1024 --completion 1024
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import SHAPES, bench_model  # noqa: E402

from rollout import Engine  # noqa: E402


def peak_bf16_flops(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    if device.type != "cuda":  # a dry run on a CPU
        n, reps = 512, 3
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_sequences(n: int, group: int, prompt: int, completion: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(n):
        if i % group == 0:
            p = torch.randint(100, vocab, (prompt,), generator=g).tolist()
        seqs.append(p + torch.randint(100, vocab, (completion,), generator=g).tolist())
    return seqs


@torch.no_grad()
def hf_score(path: Path, seqs: list[list[int]], start: int, device: torch.device, micro: int) -> float:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    _sync(device)
    t0 = time.perf_counter()
    for a in range(0, len(seqs), micro):
        ids = torch.tensor(seqs[a : a + micro], device=device)
        hidden = model.model(ids).last_hidden_state[:, start - 1 : -1]
        for row in range(ids.shape[0]):  # one row's logits at a time bounds the [T, vocab] memory
            lp = torch.log_softmax(model.lm_head(hidden[row]).float(), -1)
            lp.gather(1, ids[row, start:].unsqueeze(1))
    _sync(device)
    seconds = time.perf_counter() - t0
    del model
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--completion", type=int, default=1024)
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--hf-micro-batch", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    path = bench_model(args.model)
    engine = Engine(path, device=args.device, max_prefill_tokens=args.max_prefill_tokens)
    params = sum(p.numel() for p in engine.model.parameters())
    seqs = make_sequences(
        args.sequences, args.group, args.prompt, args.completion, engine.model_config.vocab_size
    )
    engine.score(input_ids=seqs[: args.group], start=args.prompt)  # warm-up
    engine.flush_cache()
    t0 = time.perf_counter()
    engine.score(input_ids=seqs, start=args.prompt)
    seconds = time.perf_counter() - t0
    computed = engine.last_stats["prefill_tokens"]
    total = sum(map(len, seqs))
    peak = peak_bf16_flops(device)
    floor = 2 * params * computed / peak
    engine.shutdown()
    hf_seconds = hf_score(path, seqs, args.prompt, device, args.hf_micro_batch)
    report = {
        "model": args.model,
        "sequences": args.sequences,
        "group": args.group,
        "tokens": total,
        "computed_tokens": computed,
        "score_s": round(seconds, 3),
        "score_tok_s": round(total / seconds),
        "computed_tok_s": round(computed / seconds),
        "peak_tflops": round(peak / 1e12, 1),
        "floor_s": round(floor, 3),
        "of_floor": round(floor / seconds, 3),
        "hf_s": round(hf_seconds, 3),
        "speedup_vs_hf": round(hf_seconds / seconds, 2),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
