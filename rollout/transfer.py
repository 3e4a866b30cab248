"""Host-to-device transfer of a step's small arrays in one copy.

Every host-to-device copy costs a few microseconds of host time however small it is, and a step has a
dozen small arrays (ids, positions, slots, page table, sampling parameters). They are packed into one
pinned byte buffer, copied once without blocking, and viewed back on the device with their own dtypes
and shapes (no conversion kernels). Pinned blocks come from torch's caching host allocator, which does
not reuse a block until the copy that reads it has finished.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 16  # bytes; kernels specialise on pointer alignment


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Device tensors equal to `arrays` (same dtypes and shapes), made by one host-to-device copy."""
    starts, end = [], 0
    for a in arrays:
        starts.append(end)
        end += -(-a.nbytes // ALIGN) * ALIGN
    buf = np.zeros(max(end, ALIGN), dtype=np.uint8)
    for a, start in zip(arrays, starts):
        buf[start : start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    host = torch.from_numpy(buf)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    return [
        dev[start : start + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
        for a, start in zip(arrays, starts)
    ]


_TORCH_DTYPES = {
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.bool_): torch.bool,
}
