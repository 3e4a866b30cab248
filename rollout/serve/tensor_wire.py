"""Named tensors over HTTP without pickle (docs/security.md).

`/update_weights_from_tensor` takes, per tensor-parallel rank, one string in one of these formats:
- "safetensors" (the default): base64 of safetensors bytes, name -> tensor. Parsing them reads a JSON
  header and copies bytes; no code of the sender's runs.
- "cuda_ipc": for a trainer on the same host and GPUs: a JSON list of one object per tensor holding
  the fields of its CUDA IPC handle (name, dtype, shape, stride, the handle's bytes in base64...),
  rebuilt here into a tensor over the sender's memory, again without unpickling.
- "pickle": SGLang's own payload (base64 of a pickled list of (name, tensor)). Unpickling runs whatever
  code the sender chose, so the server refuses it unless started with
  --allow-pickle-weight-updates-unsafe (and that flag needs --api-key).
The sender's side: `encode_safetensors` and `encode_cuda_ipc` (integrations.http_weights posts them).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Literal

import torch

Format = Literal["safetensors", "cuda_ipc", "pickle"]
FORMATS: tuple[str, ...] = ("safetensors", "cuda_ipc", "pickle")
PICKLE_FLAG = "--allow-pickle-weight-updates-unsafe"
_PICKLE_MAGIC = b"\x80"  # every pickle of protocol 2 or later starts with the PROTO opcode


def encode_safetensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One rank's (name, tensor) list as the "safetensors" format's string."""
    from safetensors.torch import save

    tensors = {}
    for name, t in named:
        if name in tensors:
            raise ValueError(f"named_tensors: {name!r} appears twice")
        tensors[name] = t.detach().to("cpu").contiguous()
    return base64.b64encode(save(tensors)).decode("ascii")


def encode_cuda_ipc(named: list[tuple[str, torch.Tensor]]) -> str:
    """One rank's (name, CUDA tensor) list as the "cuda_ipc" format's string. The sender keeps the
    tensors alive until the update is answered."""
    from torch.multiprocessing.reductions import reduce_tensor

    entries = []
    for name, t in named:
        if t.device.type != "cuda":
            raise ValueError(f"named_tensors: {name!r} is on {t.device}; cuda_ipc shares CUDA tensors")
        _, args = reduce_tensor(t.detach())
        (
            _,
            size,
            stride,
            offset,
            _,
            dtype,
            device,
            handle,
            nbytes,
            storage_offset,
            _,
            rc_handle,
            rc_offset,
        ) = args[:13]
        event_handle, event_sync = args[13], args[14]
        entries.append(
            {
                "name": name,
                "dtype": str(dtype).removeprefix("torch."),
                "shape": list(size),
                "stride": list(stride),
                "offset": offset,
                "device": device,
                "handle": _b64(handle),
                "storage_bytes": nbytes,
                "storage_offset_bytes": storage_offset,
                "ref_counter_handle": _b64(rc_handle),
                "ref_counter_offset": rc_offset,
                "event_handle": _b64(event_handle),
                "event_sync_required": bool(event_sync),
            }
        )
    return json.dumps(entries)


def decode(entry: str, fmt: Format | None, *, allow_pickle: bool) -> list[tuple[str, torch.Tensor]]:
    """One rank's entry as (name, tensor) pairs; a ValueError naming the field for anything else.
    `fmt` None: told apart by their first bytes (a pickle is refused, never opened, unless allowed)."""
    if fmt == "cuda_ipc":
        return _from_cuda_ipc(entry)
    raw = _unbase64(entry)
    if fmt is None:
        fmt = "pickle" if raw.startswith(_PICKLE_MAGIC) else "safetensors"
    if fmt == "pickle":
        if not allow_pickle:
            raise ValueError(
                "serialized_named_tensors: pickled payloads run code of the sender's choosing and are "
                f'refused; send format "safetensors" (integrations.http_weights), or start the server with '
                f"{PICKLE_FLAG} --api-key KEY if every client that can reach it is trusted"
            )
        import pickle

        return pickle.loads(raw)
    return _from_safetensors(raw)


def _from_safetensors(raw: bytes) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load

    try:
        tensors = load(raw)
    except Exception as e:  # safetensors raises its own error types on a bad header
        raise ValueError(f"serialized_named_tensors: not safetensors bytes ({e})") from None
    return list(tensors.items())


def _from_cuda_ipc(entry: str) -> list[tuple[str, torch.Tensor]]:
    try:
        items = json.loads(entry)
    except json.JSONDecodeError as e:
        raise ValueError(f"serialized_named_tensors: cuda_ipc entries are JSON lists ({e})") from None
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ValueError("serialized_named_tensors: a cuda_ipc entry is a JSON list of objects")
    if items and not torch.cuda.is_available():
        raise ValueError("serialized_named_tensors: cuda_ipc needs CUDA, and this server has none")
    return [(_str(i, "name"), _rebuild(i)) for i in items]


def _rebuild(i: dict) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dtype = getattr(torch, _str(i, "dtype"), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"serialized_named_tensors: unknown dtype {i.get('dtype')!r}")
    return rebuild_cuda_tensor(
        torch.Tensor,  # fixed classes: the client names none
        torch.Size(_ints(i, "shape")),
        tuple(_ints(i, "stride")),
        _int(i, "offset"),
        torch.storage.TypedStorage,
        dtype,
        _int(i, "device"),
        _unbase64(_str(i, "handle")),
        _int(i, "storage_bytes"),
        _int(i, "storage_offset_bytes"),
        False,
        _unbase64(_str(i, "ref_counter_handle")),
        _int(i, "ref_counter_offset"),
        _unbase64(i["event_handle"]) if i.get("event_handle") else None,
        bool(i.get("event_sync_required", False)),
    )


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode("ascii")


def _unbase64(s: Any) -> bytes:
    if not isinstance(s, str):
        raise ValueError("serialized_named_tensors: expected base64 text")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"serialized_named_tensors: not base64 ({e})") from None


def _str(i: dict, key: str) -> str:
    v = i.get(key)
    if not isinstance(v, str):
        raise ValueError(f"serialized_named_tensors: cuda_ipc field {key!r} must be a string, got {v!r}")
    return v


def _int(i: dict, key: str) -> int:
    v = i.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"serialized_named_tensors: cuda_ipc field {key!r} must be an int, got {v!r}")
    return v


def _ints(i: dict, key: str) -> list[int]:
    v = i.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ValueError(f"serialized_named_tensors: cuda_ipc field {key!r} must be a list of ints")
    return v
