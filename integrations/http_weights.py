"""Push a trainer's weights to `python -m rollout.serve` over HTTP without pickle.

`post_weights(url, named)` sends the (name, tensor) pairs to /update_weights_from_tensor as
safetensors bytes (the default), or, for a trainer on the server's host and GPUs, as the fields of
each tensor's CUDA IPC handle (`format="cuda_ipc"`: no copy through the host; keep the tensors alive
until the call returns). The server never unpickles either (docs/security.md). Send large models in
buckets of a few hundred MB: each call is one request body (--max-weight-body-bytes caps it).
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.serve.tensor_wire import encode_cuda_ipc, encode_safetensors

ENCODERS = {"safetensors": encode_safetensors, "cuda_ipc": encode_cuda_ipc}


def post_weights(
    url: str,
    named: list[tuple[str, torch.Tensor]],
    *,
    api_key: str | None = None,
    format: str = "safetensors",
    abort_all_requests: bool = False,
    timeout: float = 600.0,
    client: Any = None,
) -> str:
    """Update the served engine's weights; returns the server's message. Raises RuntimeError with
    the server's message when it refuses the update."""
    import httpx

    if format not in ENCODERS:
        raise ValueError(f"format must be one of {sorted(ENCODERS)}, got {format!r}")
    body = {
        "serialized_named_tensors": [ENCODERS[format](named)],
        "format": format,
        "abort_all_requests": abort_all_requests,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    post = client.post if client is not None else httpx.post
    r = post(url.rstrip("/") + "/update_weights_from_tensor", json=body, headers=headers, timeout=timeout)
    answer = r.json()
    if r.status_code != 200:
        raise RuntimeError(f"update_weights_from_tensor: HTTP {r.status_code}: {answer['error']['message']}")
    if not answer.get("success"):
        raise RuntimeError(f"update_weights_from_tensor: {answer.get('message')}")
    return answer["message"]
