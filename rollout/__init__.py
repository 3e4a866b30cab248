"""rollout: fast RL rollouts from Hugging Face causal LMs, sharing the GPU with the trainer.

The top level holds only what users import: this module's names, config, api (the one method list),
sampling, outputs and distributed (tensor-parallel groups). The folders, from the top down:
serve/ compat/ -> fronts/ process/ -> engine/ -> runner/ -> state/ attention/ cache/ models/ lora/
memory/ weights/ device/ -> layers/ (see docs/architecture.md).
"""

from rollout.engine.engine import Engine
from rollout.engine.scoring import ScoreOutput
from rollout.fronts.async_engine import AsyncEngine
from rollout.fronts.async_process import ProcessAsyncEngine
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.process.engine_process import EngineProcess
from rollout.sampling import SamplingParams

__all__ = [
    "AsyncEngine",
    "ProcessAsyncEngine",
    "Engine",
    "EngineProcess",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "ScoreOutput",
]
__version__ = "0.1.0"
