"""A process that used an engine exits 0 after success: with the memory saver on a GPU (whose pools
torch frees at interpreter shutdown), after a release, after shutdown(), and on a CPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = """
import sys
from rollout import Engine, SamplingParams
engine = Engine(sys.argv[1], device=sys.argv[2], enable_memory_saver=sys.argv[2] == "cuda",
                mem_fraction=0.3, max_total_tokens=4096)
out = engine.generate(input_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_new_tokens=4))
assert len(out[0].outputs[0].token_ids) >= 1
if sys.argv[3] == "released":
    engine.release_memory_occupation()
elif sys.argv[3] == "shutdown":
    engine.shutdown()
print("ok")
"""


def _run(path: str, device: str, ending: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), path, device, ending],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("ending", ["plain", "released", "shutdown"])
def test_cpu_process_exits_zero(qwen3_dir, ending):
    proc = _run(qwen3_dir, "cpu", ending)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("ok")


@pytest.mark.gpu
@pytest.mark.parametrize("ending", ["plain", "released", "shutdown"])
def test_memory_saver_process_exits_zero(qwen3_dir, ending):
    pytest.importorskip("torch_memory_saver")
    assert torch.cuda.is_available()
    proc = _run(qwen3_dir, "cuda", ending)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "interesting region" not in proc.stderr and proc.stdout.strip().endswith("ok")
