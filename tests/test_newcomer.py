"""What a new user met on a fresh machine (issue 37, item 9): messages and defaults, each checked."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from rollout import Engine, SamplingParams
from rollout.models.toy import build_checkpoint


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return str(build_checkpoint(tmp_path_factory.mktemp("toy") / "m", "qwen3", seed=4))


@pytest.fixture(scope="module")
def engine(toy_dir):
    return Engine(toy_dir, device="cpu", max_total_tokens=2048)


def test_the_toy_model_has_a_chat_template(engine):
    out = engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_new_tokens=2, temperature=0))
    assert out[0].prompt == "user: hi\nassistant:" and len(out[0].outputs[0].token_ids) >= 1


def test_token_ids_passed_as_prompts_point_at_input_ids(engine):
    with pytest.raises(TypeError, match="input_ids="):
        engine.generate([[5, 6, 7]])


def test_all_weights_loaded_is_said_once_not_every_step(engine, toy_dir, caplog):
    from rollout.weights.loader import iter_checkpoint, safetensors_files

    named = list(iter_checkpoint(safetensors_files(toy_dir)))
    caplog.set_level(logging.INFO, logger="rollout")
    for _ in range(3):  # what a colocated trainer does each step: discard, then push every weight
        engine.release_memory_occupation(["weights"])
        engine.resume_memory_occupation(["weights"])
        engine.update_weights_from_tensor(named)
    said = [r for r in caplog.records if "all weights loaded" in r.getMessage() and r.levelno >= logging.INFO]
    assert len(said) == 1


def test_summary_says_step_not_1_steps():
    from integrations.metrics import summary

    assert (
        summary([{"reward/mean": 0.1}, {"reward/mean": 0.9}])
        == "reward/mean: first step 0.100 -> last step 0.900"
    )


def test_a_stand_in_memory_saver_says_nothing_at_exit(caplog):
    """The exit hook warned "the exit status may be 1" when no torch_memory_saver library had started
    (tests use a stand-in module): nothing runs at exit then, so nothing to warn about."""
    import types

    from rollout.memory.saver import CudaMemorySaver

    saver = CudaMemorySaver.__new__(CudaMemorySaver)
    saver._tms, saver.device = types.SimpleNamespace(), "cuda:0"
    caplog.set_level(logging.WARNING, logger="rollout")
    saver._before_teardown()
    assert not caplog.records


@pytest.mark.slow
def test_building_a_toy_checkpoint_warns_nothing_about_torch_dtype(tmp_path):
    code = f"from rollout.models.toy import build_checkpoint; build_checkpoint({str(tmp_path / 'm')!r})"
    r = subprocess.run(
        [sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert "torch_dtype" not in r.stderr, r.stderr
