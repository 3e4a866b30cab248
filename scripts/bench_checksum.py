"""Benchmark the weight checker against one sync: is `verify=True` cheap (issue 16: <= 2x one sync)?

    python scripts/bench_checksum.py [--models qwen2.5-0.5b] [--repeat 5]

For a random checkpoint of the real shape (scripts/models.py), times, as medians: one in-process
`sync_weights` of the trainer model into the engine, `Engine.weights_checksum()` over every weight,
the trainer-side checksums of `integrations.verify_sync`, and `verify_sync` as a whole (both sides plus
the comparison). Prints each and its ratio to the sync measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_weight_sync import build, timed  # noqa: E402
from models import SHAPES  # noqa: E402

from integrations import sync_weights, verify_sync  # noqa: E402
from integrations.verify import trainer_checksums  # noqa: E402
from rollout import Engine  # noqa: E402


def synced(fn, device: torch.device):
    """`fn` followed by a device sync, so the time covers the device work."""

    def run():
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    return run


def bench_one(name: str, args, device: torch.device) -> list[str]:
    folder, model = build(name, device, getattr(torch, args.dtype))
    engine = Engine(str(folder), device=str(device), dtype=args.dtype, max_total_tokens=2048)
    cases = {
        "sync_weights (in-process)": partial(sync_weights, model, engine),
        "engine.weights_checksum()": engine.weights_checksum,
        "trainer checksums": partial(trainer_checksums, model),
        "verify_sync (both sides)": partial(verify_sync, model, engine),
    }
    times = {k: timed(synced(fn, device), args.repeat) for k, fn in cases.items()}
    sync_s = times["sync_weights (in-process)"]
    rows = [f"| {name} | {k} | {s * 1e3:.1f} | {s / sync_s:.2f} |" for k, s in times.items()]
    engine.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen2.5-0.5b", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = [row for name in args.models.split(",") for row in bench_one(name.strip(), args, device)]
    print(f"\nmedian of {args.repeat} on {device}\n| model | what | ms | x one sync |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
