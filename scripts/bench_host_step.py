"""Host time of a decode step, as the engine runs it (schedule, prepare, forward, sample, postprocess).

A tiny random checkpoint (rollout/models/toy.py) makes the forward cheap, so what is left is host overhead:
the per-step Python, numpy and tensor-call cost that issue #15 is about. For each batch size, B
requests decode `--steps` tokens through `Engine.step`; the decode steps are timed.

  step ms      wall time of one decode `Engine.step()` call
  model ms     time inside the model forward, logits and the sampler (on a CPU: their compute; on a GPU:
               their kernel launches, since the device runs asynchronously)
  host ms      step - model: building the step, planning, copying back, postprocessing

`--profile` adds a cProfile of the decode steps (top functions by own time). Runs on a CPU and on CUDA:

    python scripts/bench_host_step.py --device cpu --batch-sizes 1 64
    python scripts/bench_host_step.py --device cuda --model qwen2.5-0.5b --overlap both --profile
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.config import EngineConfig  # noqa: E402
from rollout.models.toy import build_checkpoint  # noqa: E402
from rollout.runner import model_runner  # noqa: E402

OPTIONS = {f.name for f in dataclasses.fields(EngineConfig)}


class ModelClock:
    """Accumulates the seconds spent inside the model forward, logits and the sampler."""

    def __init__(self, engine: Engine):
        self.seconds = 0.0
        runner = engine.runner
        runner.forward_hidden = self._timed(runner.forward_hidden)
        engine.model.logits = self._timed(engine.model.logits)
        model_runner.sample = self._timed(model_runner.sample)

    def _timed(self, fn):
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return wrapped


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def maybe_profile(enabled: bool, top: int):
    prof = cProfile.Profile() if enabled else None
    if prof:
        prof.enable()
    yield
    if prof:
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        print(out.getvalue())


def run_batch(engine: Engine, clock: ModelClock, batch: int, args) -> dict:
    """Decode `args.steps` tokens for `batch` requests; per decode step: wall, model and host ms."""
    params = SamplingParams(
        temperature=1.0, top_p=0.95, max_new_tokens=args.steps, ignore_eos=True, logprobs=True, seed=1
    )
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        prompt = [(7 * i + j) % (vocab - 3) + 3 for j in range(args.prompt)]
        engine.add_request(f"b{batch}-{i}", prompt, params)
    walls, models = [], []
    with maybe_profile(args.profile, args.top):
        while engine.has_unfinished():
            decode_before = engine.stats.decode_tokens
            clock.seconds = 0.0
            sync(engine.device)
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            if engine.stats.decode_tokens > decode_before:
                walls.append(wall)
                models.append(clock.seconds)
    sync(engine.device)
    keep = slice(len(walls) // 4, None)  # the first steps warm caches and allocators
    step_ms = 1e3 * sum(walls[keep]) / len(walls[keep])
    model_ms = 1e3 * sum(models[keep]) / len(models[keep])
    return dict(batch=batch, steps=len(walls), step_ms=step_ms, model_ms=model_ms, host_ms=step_ms - model_ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a checkpoint folder or a scripts/models.py shape (default: a toy one)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=64, help="tokens decoded per request")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--overlap", choices=["on", "off", "both"], default="both")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile the decode steps")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier timings)")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.model is None:
        folder = build_checkpoint(Path(tempfile.mkdtemp()) / "toy", "qwen3", tokenizer=False)
    else:
        from models import SHAPES, bench_model

        folder = bench_model(args.model) if args.model in SHAPES else Path(args.model)
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.overlap]
    for overlap in modes:
        engine = Engine(
            str(folder),
            device=args.device,
            attention_backend=args.backend,
            max_running_requests=max(args.batch_sizes),
            max_total_tokens=max(args.batch_sizes) * (args.prompt + args.steps + 32) + 4096,
            cuda_graph=not args.no_graphs,
            **({"overlap_schedule": overlap} if "overlap_schedule" in OPTIONS else {}),
        )
        label = overlap if "overlap_schedule" in OPTIONS else "n/a"
        print(f"{args.device} {folder.name} backend={engine.backend_name} overlap={label}")
        clock = ModelClock(engine)
        run_batch(
            engine, clock, max(args.batch_sizes), argparse.Namespace(**{**vars(args), "profile": False})
        )
        print(f"{'batch':>5} {'steps':>5} {'step ms':>8} {'model ms':>9} {'host ms':>8}")
        for bs in args.batch_sizes:
            r = run_batch(engine, clock, bs, args)
            cols = f"{r['step_ms']:>8.3f} {r['model_ms']:>9.3f} {r['host_ms']:>8.3f}"
            print(f"{r['batch']:>5} {r['steps']:>5} {cols}")
        engine.shutdown()


if __name__ == "__main__":
    main()
