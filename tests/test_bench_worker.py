"""scripts/bench_worker.py end to end on the CPU (tiny model): both phases run, every streamed token
is counted (the two phases' token counts agree), and the ratio line is printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_worker.py"


def test_bench_worker_runs_on_the_cpu():
    cmd = [sys.executable, str(SCRIPT), "--model", "tiny", "--device", "cpu"]
    cmd += ["--requests", "6", "--max-input", "40", "--max-output", "12", "--repeats", "1"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    runs = {line.split(":")[0]: line for line in lines if line.startswith(("Engine.generate:", "streamed:"))}
    assert set(runs) == {"Engine.generate", "streamed"}
    for line in runs.values():  # every token both ways: 6 requests of 12 tokens each (ignore_eos)
        assert re.match(r"[\w.]+: 72 tokens in [\d.]+ s, [\d,]+ tok/s; \d+ steps", line), line
    assert re.search(r"streamed / Engine.generate output tok/s: [\d,]+ / [\d,]+ = \d+\.\d{3}$", lines[-1])
