"""SGLang's wire format for tensors, for trainers that run without SGLang installed.

SGLang's `MultiprocessingSerializer` pickles with `multiprocessing.reduction.ForkingPickler`, so a
tensor travels as a handle (CUDA IPC for a GPU tensor, shared memory for a CPU one), optionally base64
encoded for HTTP. `LocalSerializedTensor` carries one such payload per tensor-parallel rank. The names
and fields here match SGLang's, so payloads made by either side load on the other.

Unpickling runs code chosen by whoever made the payload: accept payloads only from processes of the
same user (the trainer next to the engine), never from the network at large.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj: Any, output_str: bool = False) -> bytes | str:
        """ForkingPickler bytes of `obj`; `output_str=True` returns them base64-encoded."""
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        data = buf.getvalue()
        return base64.b64encode(data).decode("ascii") if output_str else data

    @staticmethod
    def deserialize(data: bytes | str) -> Any:
        """The object back from bytes or base64 text (a same-user trust boundary: see the module)."""
        if isinstance(data, str):
            try:
                data = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError) as e:
                raise ValueError(f"serialized payload is not valid base64: {e}") from None
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"serialized payload must be bytes or a base64 str, got {type(data).__name__}")
        try:
            return pickle.loads(data)
        except Exception as e:  # a truncated or foreign payload: say so instead of a pickle traceback
            raise ValueError(f"serialized payload cannot be unpickled: {type(e).__name__}: {e}") from None


@dataclass
class LocalSerializedTensor:
    """One tensor serialized once per tensor-parallel rank (`values[rank]`), as SGLang defines it."""

    values: list[bytes | str]

    def get(self, rank: int) -> Any:
        if not 0 <= rank < len(self.values):
            raise ValueError(f"LocalSerializedTensor holds {len(self.values)} payloads, none for rank {rank}")
        return MultiprocessingSerializer.deserialize(self.values[rank])


def serialize_tensors(named_tensors: list[tuple[str, Any]], output_str: bool = False) -> bytes | str:
    """One payload holding a list of (name, tensor) pairs (what SGLang sends per rank)."""
    return MultiprocessingSerializer.serialize(list(named_tensors), output_str=output_str)


def deserialize_tensors(data: bytes | str) -> Any:
    return MultiprocessingSerializer.deserialize(data)
