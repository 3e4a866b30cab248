"""The engine's settings, checked once and frozen."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str = "auto"  # auto: the checkpoint's half dtype on a GPU (bfloat16 for float32), float32 on a CPU
    seed: int = 0
    mem_fraction: float = 0.85  # GPU: share of the device's memory for weights + KV cache + graphs
    max_total_tokens: int | None = (
        None  # KV pool size in tokens (default: from mem_fraction, or 32768 on a CPU)
    )
    max_running_requests: int = 256
    max_model_len: int | None = None
    max_prefill_tokens: int = 8192  # token budget of one prefill step (chunked prefill)
    # a prefill step also decodes one token of each running sequence (SGLang's enable_mixed_chunk, vLLM's
    # chunked prefill): arrivals one by one then cost no extra steps for the others
    mixed_chunk: bool = True
    page_size: int = 16
    enable_prefix_cache: bool = True
    attention_backend: str = "auto"
    cuda_graph: bool = True
    cuda_graph_max_bs: int | None = None  # default: max_running_requests
    enable_memory_saver: bool = False
    tp_size: int = 1  # ranks sharing one model (consecutive ranks of the torchrun world)
    tp_timeout: float = 600.0  # seconds a tensor-parallel collective waits for the other ranks
    log_level: str | None = None
    max_loras: int = 0  # LoRA adapter slots (0: LoRA off, the forward pays nothing); see docs/lora.md
    max_lora_rank: int = 64  # the largest adapter rank a slot holds
    # launch step k+1 before collecting step k, so the host prepares a step while the device runs the
    # last one (tokens come back one step late; outputs are unchanged). See docs/architecture.md.
    # None: on for one CUDA device (where the host work hides behind the device's), off otherwise
    overlap_schedule: bool | None = None
    # MoE models: keep the experts each MoE layer chose for every cached token (a store beside the KV
    # cache), so requests may ask for them with SamplingParams.return_routed_experts (docs/moe.md)
    enable_return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)):
            raise TypeError(f"model must be a checkpoint folder path, got {type(self.model).__name__}")
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model: {str(self.model)!r} is not a folder with a config.json")
        object.__setattr__(self, "model", str(self.model))
        if self.dtype not in (*DTYPES, "auto"):
            raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {self.dtype!r}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        for name in ("max_running_requests", "max_prefill_tokens", "page_size", "tp_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        number = isinstance(self.tp_timeout, (int, float)) and not isinstance(self.tp_timeout, bool)
        if not number or not self.tp_timeout > 0:
            raise ValueError(f"tp_timeout must be a positive number of seconds, got {self.tp_timeout!r}")
        for name in ("max_total_tokens", "max_model_len", "cuda_graph_max_bs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")

        for name in ("mixed_chunk", "enable_return_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.overlap_schedule is not None and not isinstance(self.overlap_schedule, bool):
            raise TypeError(f"overlap_schedule must be a bool or None, got {self.overlap_schedule!r}")
        for name, low in (("max_loras", 0), ("max_lora_rank", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

    @property
    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.torch_device.type == "cpu":
            return torch.float32
        return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16
