"""LoRA adapters applied unmerged in the forward, several per batch (see docs/lora.md).

May import: layers/ and the top-level value modules. Never runner/ or above.
"""

from rollout.lora.config import AdapterConfig
from rollout.lora.layers import LoraLinear, LoraState
from rollout.lora.manager import Adapter, LoraManager

__all__ = ["Adapter", "AdapterConfig", "LoraLinear", "LoraManager", "LoraState"]
