"""scripts/bench_serve.py end to end on the CPU (tiny model, a few streams): both serving modes, two
server processes, a stream interval, cores of their own for the clients and timelines, every stream
counted whole, the figures written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_serve.py"


def test_bench_serve_runs_on_the_cpu(tmp_path):
    out = tmp_path / "serve.json"
    cmd = [sys.executable, str(SCRIPT), "--model", "tiny", "--device", "cpu", "--cuda-graph", "0"]
    cmd += ["--requests", "8", "--clients", "8", "--max-input", "40", "--max-output", "24"]
    cmd += [
        "--mode",
        "both",
        "--api-servers",
        "2",
        "--stream-interval",
        "2",
        "--json",
        str(out),
        "--timeline",
    ]
    cores = len(os.sched_getaffinity(0))
    if cores > 1:
        cmd += ["--client-cores", "1"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "server processes: 2" in proc.stdout
    # a timeline for each Engine.generate run and each served one, its steps those of the run's line
    assert proc.stdout.count("t s | steps | prefill | inside s | running | waiting") == 2
    served = next(line for line in proc.stdout.splitlines() if line.startswith("served: "))
    steps = int(served.split()[1])
    rows = [line.split("|") for line in proc.stdout.split("t s | steps")[-1].splitlines()[1:]]
    last = [r for r in rows if len(r) == 6][-1]  # the served run's table ends its output's tables
    assert int(last[1]) == steps
    found = json.loads(out.read_text())
    assert found["api_servers"] == 2 and found["stream_interval"] == 2
    assert found["client_cores"] == (1 if cores > 1 else 0)
    for key in ("engine_generate_tok_s", "thread_stream_tok_s", "process_stream_tok_s"):
        assert found[key] > 0, key
    assert found["server_cpu_us_per_token"] > 0 and 0 < found["server_cpu_s_per_s"] <= 1.5
