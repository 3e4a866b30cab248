"""Synthetic tasks, metrics logging and the examples' config checks (no training here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from integrations.metrics import MetricsLogger, PhaseTimer, console_line, rollout_metrics, summary
from integrations.tasks import REPEAT_LEN, Task, answer_score, char_tokenizer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    """Import examples/<name>.py (examples are scripts, not a package)."""
    module = f"example_{name}"
    if module not in sys.modules:
        spec = importlib.util.spec_from_file_location(module, EXAMPLES / f"{name}.py")
        sys.modules[module] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module])
    return sys.modules[module]


@pytest.mark.parametrize(
    "completion, score",
    [("777", 1.0), ("77", 2 / 3), ("7777", 3 / 4), ("", 0.0), ("x77", 2 / 3), ("abc", 0.0), ("7x7", 2 / 3)],
)
def test_answer_score_by_hand(completion, score):
    assert answer_score(completion, "777") == pytest.approx(score)


def test_tasks_are_seeded_and_right():
    a, b = Task("repeat", seed=3).sample(20), Task("repeat", seed=3).sample(20)
    assert a == b and len({p.prompt for p in a}) > 1
    for p in a:
        assert p.prompt == f"{p.answer[0]}:" and p.answer == p.answer[0] * REPEAT_LEN
        assert Task.reward(p, p.answer) == 1.0
    for p in Task("add", seed=0).sample(20):
        x, y = p.prompt.rstrip("=").split("+")
        assert int(p.answer) == int(x) + int(y)
    for p in Task("reverse", seed=0).sample(5):
        assert p.answer == p.prompt[:-1][::-1]
    with pytest.raises(ValueError, match="task must be one of"):
        Task("chess")
    with pytest.raises(ValueError, match="answer"):
        answer_score("x", "")
    for p in Task("copy", seed=0).sample(5):
        assert p.answer == p.prompt[:-1] and Task.reward(p, p.answer[::-1] + "!") < 1


def test_char_tokenizer_round_trips_prompts():
    tok = char_tokenizer()
    ids = tok.encode("7+3=")
    assert len(ids) == 4 and tok.decode(ids) == "7+3="
    assert tok.decode([*ids, 10**6, tok.eos_token_id], skip_special_tokens=True) == "7+3="  # unknown ids drop


def test_rollout_metrics_by_hand():
    m = rollout_metrics([1.0, 0.0, 0.5, 0.5], [4, 2, 2, 0], generate_seconds=2.0)
    assert m["reward/mean"] == 0.5 and m["reward/std"] == pytest.approx(0.5**1.5)
    assert m["reward/solved"] == 0.25 and m["length/mean"] == 2.0 and m["length/max"] == 4.0
    assert m["throughput/gen_tokens_per_s"] == 4.0


def test_summary_compares_first_and_last_fifth():
    history = [{"reward/mean": r} for r in [0.0, 0.2, 0.4, 0.5, 0.6, 0.6, 0.8, 0.8, 0.9, 1.0]]
    assert summary(history) == "reward/mean: first 2 steps 0.100 -> last 2 steps 0.950"


def test_phase_timer_and_console_line():
    timer = PhaseTimer("cpu")
    for _ in range(2):
        with timer("sync"):
            pass
    with pytest.raises(RuntimeError), timer("train"):
        raise RuntimeError("boom")  # a failing phase is still timed
    assert set(timer.metrics()) == {"time/sync", "time/train"}
    line = console_line(3, {"reward/mean": 0.5, "logprob_gap/max": 2e-7, "time/sync": 0.25, "other": 1.0})
    assert line == "step 3 | reward 0.500 | max 2.0e-07 | sync 0.25s"


def test_metrics_logger_console_and_history(capsys):
    with MetricsLogger(2, progress=False) as logger:
        logger.log(0, {"reward/mean": 0.1})
        logger.log(1, {"reward/mean": 0.2})
    assert logger.history == [{"step": 0, "reward/mean": 0.1}, {"step": 1, "reward/mean": 0.2}]
    assert logger.run_dir is None
    assert "step 1 | reward 0.200" in capsys.readouterr().out


def test_metrics_logger_writes_offline_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsLogger(
        1, use_wandb=True, wandb_dir=str(tmp_path), config={"lr": 1e-3}, progress=False
    ) as logger:
        logger.log(0, {"reward/mean": 0.1, "time/train": 0.5})
        run_dir = Path(logger.run_dir)
    assert run_dir.parent == tmp_path / "wandb" and run_dir.name.startswith("offline-run-")
    assert list(run_dir.glob("*.wandb"))


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_example_configs_reject_bad_values(name):
    ex = load_example(name)
    with pytest.raises(ValueError, match="do not split evenly into minibatches=4"):
        ex.Config(batch=3, n=2, minibatches=4)
    with pytest.raises(ValueError, match="task must be one of"):
        ex.Config(task="chess")
    with pytest.raises(ValueError, match="steps must be >= 1"):
        ex.parse_args(["--steps", "0"])
    with pytest.raises(ValueError, match="lr must be > 0"):
        ex.parse_args(["--lr", "-1"])
    cfg = ex.parse_args(["--batch", "4", "--n", "2", "--minibatches", "2", "--wandb", "--device", "cpu"])
    assert (cfg.batch, cfg.n, cfg.minibatches, cfg.wandb, cfg.device) == (4, 2, 2, True, "cpu")


def test_grpo_needs_two_samples_per_prompt():
    grpo = load_example("grpo")
    with pytest.raises(ValueError, match="n must be >= 2"):
        grpo.Config(n=1)
    with pytest.raises(ValueError, match="n must be >= 2"):
        grpo.parse_args(["--n", "1"])
    assert load_example("ppo").Config(n=1, minibatches=1).n == 1  # PPO needs no groups
