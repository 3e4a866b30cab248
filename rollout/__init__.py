"""rollout: fast RL rollouts from Hugging Face causal LMs, sharing the GPU with the trainer."""

from rollout.async_engine import AsyncEngine
from rollout.async_process import ProcessAsyncEngine
from rollout.engine import Engine
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.process import EngineProcess
from rollout.sampling import SamplingParams
from rollout.scoring import ScoreOutput

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
