"""scripts/bench_rl_step.py runs examples/grpo.py's loop on the tiny model and accounts for each step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_rl_step  # noqa: E402


def test_bench_rl_step_breakdown_on_the_tiny_model(capsys):
    rows = bench_rl_step.main(["--steps", "2", "--batch", "2", "--n", "2", "--max-new-tokens", "4",
                               "--device", "cpu", "--profile"])  # fmt: skip
    assert len(rows) == 2
    for row in rows:
        phases = sum(row[p] for p in bench_rl_step.PHASES)
        assert all(row[p] > 0 for p in bench_rl_step.PHASES)
        assert row["step"] == pytest.approx(phases + row["other"])
        assert 0 < bench_rl_step.outside_share(row) < 1
    out = capsys.readouterr().out
    assert "| mean 1-1 |" in out and "outside generate+train" in out
    assert "release + resume + sync, cumulative time" in out and "sync_weights" in out
