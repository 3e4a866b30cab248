"""The engine worker's cost without HTTP: ProcessAsyncEngine.stream against Engine.generate.

The same requests (random prompt tokens, fixed seed, temperature 0.6, ignore_eos) run once through
Engine.generate and once streamed from a ProcessAsyncEngine (the engine worker in a child process,
every token sent back to this process), each in a process of its own, --repeats times. For each run it
prints the wall time, the steps, the time a step takes by the wall and inside `Engine.step`: the
difference is the worker's own work between steps (commands, token deltas, sends), and a step that takes
longer inside than Engine.generate's is slowed by what runs beside it (the sender thread, the parent).
The last line is the ratio of the best runs' output tok/s (streamed / Engine.generate).

    python scripts/bench_worker.py --model qwen2.5-0.5b --requests 256 --max-output 256
    OMP_NUM_THREADS=1 python scripts/bench_worker.py --model tiny --device cpu --requests 32 --max-output 150
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_serve import in_own_process, workload  # noqa: E402
from models import SHAPES, model_folder  # noqa: E402

from rollout import Engine, ProcessAsyncEngine, SamplingParams  # noqa: E402
from rollout.models.config import ModelConfig  # noqa: E402

COUNTS = ("steps", "prefill_steps", "step_seconds")


def line(name: str, before, after, seconds: float, tokens: int) -> float:
    d = {k: getattr(after, k) - getattr(before, k) for k in COUNTS}
    steps = max(d["steps"], 1)
    print(
        f"{name}: {tokens} tokens in {seconds:.3f} s, {tokens / seconds:,.0f} tok/s; {d['steps']} steps "
        f"({d['prefill_steps']} prefill), {seconds / steps * 1e3:.2f} ms a step, "
        f"{d['step_seconds'] / steps * 1e3:.2f} ms inside",
        flush=True,
    )
    return tokens / seconds


Prompts = list[list[int]]


def run_generate(folder: str, opts: dict, prompts: Prompts, sp: SamplingParams, repeats: int, q) -> None:
    engine = Engine(folder, **opts)
    engine.generate(input_ids=prompts[:2], sampling_params=SamplingParams(max_new_tokens=4), use_tqdm=False)
    best = 0.0
    for _ in range(repeats):
        engine.flush_cache()
        before, t = engine.stats, time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        best = max(best, line("Engine.generate", before, engine.stats, time.perf_counter() - t, tokens))
    engine.shutdown()
    q.put(best)


def run_streamed(folder: str, opts: dict, prompts: Prompts, sp: SamplingParams, repeats: int, q) -> None:
    async def one(engine: ProcessAsyncEngine, ids: list[int]) -> int:
        tokens = 0
        async for out in engine.stream(input_ids=ids, sampling_params=sp):
            tokens += len(out.outputs[0].token_ids)  # each output holds the tokens since the last
        return tokens

    async def main() -> float:
        engine = ProcessAsyncEngine(folder, **opts)
        await engine.generate(input_ids=prompts[0][:8], sampling_params=SamplingParams(max_new_tokens=4))
        best = 0.0
        for _ in range(repeats):
            await engine.flush_cache()
            before, t = engine.stats, time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(engine, p) for p in prompts)))
            best = max(best, line("streamed", before, engine.stats, time.perf_counter() - t, tokens))
        await engine.shutdown()
        return best

    q.put(asyncio.run(main()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", help=f"a folder, 'tiny', or one of {sorted(SHAPES)}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-input", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.requests < 1 or args.max_input < 4 or args.max_output < 1 or args.repeats < 1:
        raise SystemExit("--requests, --max-output and --repeats must be positive, --max-input at least 4")
    folder = model_folder(args.model)
    vocab = ModelConfig.from_path(folder).vocab_size
    # its prompts; every request makes --max-output tokens (the workload's lengths are not used)
    prompts, _ = workload(vocab, 0, args.requests, args.max_input, args.max_output)
    sp = SamplingParams(temperature=0.6, max_new_tokens=args.max_output, ignore_eos=True)
    opts = dict(device=args.device, max_running_requests=args.requests)
    # each phase in a process of its own, so two engines never hold the device at once
    gen = in_own_process(run_generate, str(folder), opts, prompts, sp, args.repeats)
    streamed = in_own_process(run_streamed, str(folder), opts, prompts, sp, args.repeats)
    print(f"streamed / Engine.generate output tok/s: {streamed:,.0f} / {gen:,.0f} = {streamed / gen:.3f}")


if __name__ == "__main__":
    main()
