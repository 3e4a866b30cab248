"""Summarise a py-spy raw profile per process role: where each process's interpreter time goes.

Record with `py-spy record --subprocesses --gil --format raw -r RATE -o FILE -- python3 scripts/...`
(with --gil a sample is the thread holding the interpreter lock, so a process's samples over
RATE x seconds is the share of the time its lock was busy). Each process is named by the first of
ROLES whose marker shows in its stacks; for each role this prints its samples, then the functions
that were running (self) and the rollout/ and serving functions that were on the stack (inclusive).

    python scripts/spy_report.py FILE [--rate 250] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import re

# role -> a frame marker that only that process runs (checked in this order)
ROLES = {
    "engine worker": "_Worker._turns",
    "clients": "run_clients (",
    "server": "uvicorn",
    "engine": "Engine.generate",
}
# start-up work (imports, engine and model building) is counted apart from the steady state
STARTUP = (
    "<frozen importlib",
    "Engine.__init__",
    "ProcessAsyncEngine.__init__",
    "prepare (multiprocessing/spawn.py",
)
WATCH = ("rollout/", "starlette", "uvicorn", "fastapi", "httpx", "json/", "pickle", "asyncio/")


def parse(path: str) -> dict[str, list[tuple[list[str], int]]]:
    """pid -> [(frames below the process frames, count)]."""
    by_pid: dict[str, list] = collections.defaultdict(list)
    lead = re.compile(r'process (\d+):"[^"]*";?')  # a command line may hold ';'
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        pid, pos = "?", 0
        while m := lead.match(stack, pos):
            pid, pos = m.group(1), m.end()
        if stack[pos:]:
            by_pid[pid].append((stack[pos:].split(";"), int(n)))
    return by_pid


def role(samples: list[tuple[list[str], int]]) -> str:
    text = {f for frames, _ in samples for f in frames}
    for name, marker in ROLES.items():
        if any(marker in f for f in text):
            return name
    return "other"


def short(frame: str) -> str:
    """'fn (path/to/file.py:12)' -> 'fn (file.py)' so lines of one function add up."""
    m = re.match(r"(.*) \((.*?):\d+\)$", frame)
    return f"{m.group(1)} ({m.group(2).split('site-packages/')[-1]})" if m else frame


def report(path: str, rate: float, top: int) -> None:
    for pid, samples in sorted(parse(path).items(), key=lambda kv: -sum(n for _, n in kv[1])):
        name = role(samples)
        start = sum(n for frames, n in samples if any(m in f for f in frames for m in STARTUP))
        samples = [(f, n) for f, n in samples if not any(m in x for x in f for m in STARTUP)]
        total = sum(n for _, n in samples)
        if total < 20:
            continue
        own: collections.Counter = collections.Counter()
        incl: collections.Counter = collections.Counter()
        for frames, n in samples:
            own[short(frames[-1])] += n
            for f in {short(f) for f in frames if any(w in f for w in WATCH)}:
                incl[f] += n
        print(
            f"\n== {name} (pid {pid}): {total / rate:.2f} s holding the lock"
            f" ({start / rate:.2f} s more in start-up)"
        )
        print("   self:")
        for f, n in own.most_common(top):
            print(f"   {100 * n / total:5.1f}%  {f}")
        print("   on the stack:")
        for f, n in incl.most_common(top):
            print(f"   {100 * n / total:5.1f}%  {f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--rate", type=float, default=250.0, help="the -r py-spy sampled at")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    report(args.file, args.rate, args.top)


if __name__ == "__main__":
    main()
