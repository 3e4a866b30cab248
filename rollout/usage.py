"""User mistakes on the command line: one line naming the mistake, exit status 2, no traceback."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn


def die(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def mistake(model: str | None, device: str | None) -> str | None:
    """What is wrong with a model folder and a device named on a command line (None: nothing)."""
    if model is not None:
        folder = Path(model)
        if not folder.is_dir():
            return f"model folder {model!r} does not exist"
        if not (folder / "config.json").is_file():
            return f"model folder {model!r} has no config.json (not a Hugging Face checkpoint)"
    if device is not None and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return f"--device {device}: CUDA is not available on this machine (use --device cpu)"
    return None
