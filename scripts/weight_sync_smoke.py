"""Weight-sync smoke test: does every transport on this machine deliver the trainer's exact weights?

    python scripts/weight_sync_smoke.py [--model CHECKPOINT] [--device cuda|cpu]

For each transport available here (in-process tensors, in-process flattened buckets, EngineProcess by
CUDA IPC or shared memory, gloo broadcast, NCCL broadcast with two GPUs) it perturbs a transformers
copy of the model, syncs it into an engine, then checks that `get_weights_by_name` equals the
trainer's tensors exactly and that the engine's greedy tokens and logprobs match transformers'. It
prints one line per transport and exits 1 if any failed. Without --model it uses a tiny random model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from integrations import BroadcastSender, sync_weights
from rollout import Engine, SamplingParams
from rollout.process.engine_process import EngineProcess

NEW_TOKENS = 16
# transformers and the engine run different kernels: in half precision a near-tie may pick another
# token, so each greedy token is compared with transformers' argmax after the same prefix
LOGPROB_TOL = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint folder (default: a tiny random Qwen3)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(_tiny_model(Path(tmp)))
        return run(path, torch.device(args.device), int(args.bucket_mb * 2**20), args.max_total_tokens)


def _tiny_model(folder: Path) -> Path:
    from rollout.models.toy import build_checkpoint

    return build_checkpoint(folder / "tiny", "qwen3", seed=0, tie_word_embeddings=True)


def run(path: str, device: torch.device, bucket_bytes: int, max_total_tokens: int) -> int:
    from transformers import AutoModelForCausalLM

    opts = dict(device=str(device), max_total_tokens=max_total_tokens)
    probe = Engine(path, **opts)
    dtype, vocab = probe.dtype, probe.model_config.vocab_size
    del probe
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    prompts = [
        torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17)
    ]
    print(f"model {path} on {device}, {dtype}; bucket {bucket_bytes / 2**20:g} MB")
    failures = 0
    for i, (name, target) in enumerate(transports(path, device, opts)):
        with target() as (engine, sink, extra):
            perturb(trainer, seed=i)  # a new model each time: a sync that did nothing fails
            t0 = time.perf_counter()
            stats = sync_weights(trainer, sink, bucket_bytes=bucket_bytes, **extra)
            elapsed = time.perf_counter() - t0
            ok, detail = check(engine, trainer, prompts, dtype)
        failures += not ok
        print(
            f"{name:<34} {'OK  ' if ok else 'FAIL'} sync {elapsed * 1e3:8.1f} ms "
            f"({stats.buckets} buckets, {stats.bytes / 2**20:.1f} MB)  {detail}",
            flush=True,
        )
    return 1 if failures else 0


def transports(path: str, device: torch.device, opts: dict) -> Iterator[tuple[str, Callable]]:
    @contextmanager
    def in_process(flatten: bool):
        engine = Engine(path, **opts)
        yield engine, engine, {"flatten": flatten}

    @contextmanager
    def process():
        with EngineProcess(path, **opts) as p:
            yield p, p, {}

    @contextmanager
    def broadcast(backend: str, engine_device: str, sender_device: str):
        with EngineProcess(path, **{**opts, "device": engine_device}) as p:
            with BroadcastSender.for_engine(p, backend, device=sender_device, timeout=120) as sender:
                # a sender cannot ask the engine's dtype: cast to it before sending
                yield p, sender, {"dtype": getattr(torch, p.info["dtype"].removeprefix("torch."))}

    yield "in-process (tensors)", lambda: in_process(False)
    yield "in-process (flattened bucket)", lambda: in_process(True)
    ipc = "CUDA IPC" if device.type == "cuda" else "shared memory"
    yield f"EngineProcess ({ipc})", process
    yield "broadcast gloo -> EngineProcess", lambda: broadcast("gloo", str(device), "cpu")
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        yield "broadcast nccl cuda:0 -> cuda:1", lambda: broadcast("nccl", "cuda:1", "cuda:0")


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
        p.add_((noise * 0.05 * p.float().abs().mean()).to(p.dtype))


@torch.no_grad()
def check(engine, trainer, prompts: list[list[int]], dtype: torch.dtype) -> tuple[bool, str]:
    names = [n for n, _ in trainer.named_parameters()]
    weight_diff = max(
        (engine.get_weights_by_name(n).float() - trainer.get_parameter(n).detach().float().cpu())
        .abs()
        .max()
        .item()
        for n in names
    )
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
    outs = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    same, lp_diff = 0, 0.0
    device = next(trainer.parameters()).device
    for prompt, out in zip(prompts, outs):
        toks = out.outputs[0].token_ids
        ids = torch.tensor([prompt + toks], device=device)
        logits = trainer(ids).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1)
        lp_diff = max(
            lp_diff,
            (
                ref.gather(1, torch.tensor(toks, device=device)[:, None])[:, 0].cpu()
                - torch.tensor(out.outputs[0].logprobs)
            )
            .abs()
            .max()
            .item(),
        )
        hf_tokens = ref.argmax(-1).tolist()  # transformers' greedy choice after the engine's prefix
        same += sum(a == b for a, b in zip(toks, hf_tokens))
    total = NEW_TOKENS * len(prompts)
    ok = weight_diff == 0 and lp_diff < LOGPROB_TOL[dtype] and (dtype != torch.float32 or same == total)
    return ok, f"max|dw| {weight_diff:.1e}  tokens {same}/{total} agree  max|dlogprob| {lp_diff:.1e}"


if __name__ == "__main__":
    sys.exit(main())
