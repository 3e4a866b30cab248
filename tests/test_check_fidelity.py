"""scripts/check_fidelity.py on a tiny model on the CPU: it passes the engine and catches planted errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import check_fidelity as cf  # noqa: E402

from rollout.models.toy import build_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fidelity") / "tiny"
    return build_checkpoint(folder, "qwen2", seed=7, max_position_embeddings=2048)  # room for 1500 tokens


def test_passes_on_a_correct_engine(tiny):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    script = ROOT / "scripts" / "check_fidelity.py"
    cmd = [sys.executable, str(script), "--model", str(tiny), "--new-tokens", "6"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "prompts of [7, 511, 1500] tokens" in res.stdout
    row = next(line for line in res.stdout.splitlines() if line.startswith("torch"))
    assert row.split()[1] == str(6 + 510 + 1499 + 3 * 6)  # every prompt token after the first, every new one
    assert row.endswith("ok")


def perturb_engine(monkeypatch, scale: float) -> None:
    """The engine's copy of one weight is changed after loading; transformers reads the folder."""
    make = cf.make_engine

    def make_and_perturb(*args, **kwargs):
        engine = make(*args, **kwargs)
        with torch.no_grad():
            engine.model.model.layers[0].mlp.down_proj.weight[3, 5] += scale
        return engine

    monkeypatch.setattr(cf, "make_engine", make_and_perturb)


def test_catches_one_changed_weight(tiny, monkeypatch, capsys):
    perturb_engine(monkeypatch, 0.05)
    assert cf.main(["--model", str(tiny), "--lengths", "7", "300", "--new-tokens", "4"]) == 1
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-3].endswith("FAIL")
    # where the gaps are, per prompt: a changed weight of layer 0 shows at every position
    assert lines[-2].startswith("  torch: 7 tokens: mean ") and "; 300 tokens: mean " in lines[-2]


def test_catches_a_folder_changed_after_the_engine_loaded(tiny, tmp_path, monkeypatch, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(tiny, tmp_path / "copy"))
    make = cf.make_engine

    def make_then_edit_folder(*args, **kwargs):
        engine = make(*args, **kwargs)
        weights = load_file(folder / "model.safetensors")
        weights["model.norm.weight"][0] *= 1.5
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        return engine

    monkeypatch.setattr(cf, "make_engine", make_then_edit_folder)
    assert cf.main(["--model", str(folder), "--lengths", "50", "--new-tokens", "4"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_bfloat16_is_judged_against_transformers_in_bfloat16(tiny, monkeypatch, capsys):
    args = ["--model", str(tiny), "--dtype", "bfloat16", "--lengths", "7", "300", "--new-tokens", "4"]
    assert cf.main(args) == 0
    out = capsys.readouterr().out
    assert "HF bfloat16 vs fp32" in out and out.rstrip().splitlines()[-2].endswith("ok")
    perturb_engine(monkeypatch, 0.5)  # far past what bfloat16 rounding moves
    assert cf.main(args) == 1


def test_pass_rules():
    assert cf.Row("torch", 10, 1e-6, 9e-5, None, None).passed
    assert not cf.Row("torch", 10, 1e-6, 2e-4, None, None).passed  # float32: the max gap counts
    assert cf.Row("triton", 10, 1.05e-2, 1.0, 1e-2, 0.5).passed  # half: the mean-gap ratio counts
    assert not cf.Row("triton", 10, 1.2e-2, 0.1, 1e-2, 0.5).passed
    table = cf.table([cf.Row("triton", 10, 1.2e-2, 0.1, 1e-2, 0.5)], "bfloat16")
    assert "1.20" in table and "FAIL" in table


def test_prompt_file_takes_text_and_token_ids(tmp_path, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    file = tmp_path / "prompts.txt"
    file.write_text("12+7=\n\n[5, 6, 7]\n")
    assert cf.read_prompts(file, tok) == [tok.encode("12+7="), [5, 6, 7]]
    with pytest.raises(ValueError, match="need a tokenizer"):
        cf.read_prompts(file, None)
