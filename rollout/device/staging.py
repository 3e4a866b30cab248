"""Host-to-device transfer of a step's small arrays in one copy.

Every host-to-device copy costs a few microseconds of host time however small it is, and a step has a
dozen small arrays (ids, positions, slots, page table, sampling parameters). They are packed into one
pinned byte buffer, copied once without blocking, and viewed back on the device with their own dtypes
and shapes (no conversion kernels).

The pinned buffers are a `Staging` ring owned by whoever uploads every step (the model runner, the
flashinfer backend): each slot is written in place and reused once the event recorded after its copy
has passed, which in a ring this deep it has long before. Without one, every call pins a fresh buffer
through torch's caching host allocator: a second host copy, the allocator's bookkeeping, and a
`cudaHostAlloc` whenever no freed block of the size is ready.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 16  # bytes; kernels specialise on pointer alignment
SLOTS = 32  # uploads in flight at most: a handful per step, the host a step or two ahead
MIN_SLOT_BYTES = 64 << 10


class Staging:
    """A ring of pinned host buffers for `to_device` on one device; one thread uses it at a time."""

    def __init__(self, device: torch.device, slots: int = SLOTS):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0
        self.grown = 0  # buffers pinned so far (a steady step loop stops growing them)

    def take(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """A pinned buffer of at least `nbytes` whose last copy has finished, and its slot."""
        slot, self._next = self._next, (self._next + 1) % len(self._buffers)
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # the copy that last read this slot has finished
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, MIN_SLOT_BYTES, 2 * (0 if buf is None else buf.numel()))
            pin = self.device.type == "cuda"
            buf = self._buffers[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            self.grown += 1
        return buf, slot

    def copied(self, slot: int) -> None:
        """Mark `slot`'s copy as queued on the current stream: the slot is reused after it."""
        if self.device.type != "cuda":
            return  # the copy has already happened
        event = self._events[slot]
        if event is None:
            event = self._events[slot] = torch.cuda.Event()
        event.record()


def to_device(
    arrays: list[np.ndarray], device: torch.device, staging: Staging | None = None
) -> list[torch.Tensor]:
    """Device tensors equal to `arrays` (same dtypes and shapes), made by one host-to-device copy,
    staged in `staging`'s ring (one for `device`) when given, else in a buffer made for this call."""
    starts, end = [], 0
    for a in arrays:
        starts.append(end)
        end += -(-a.nbytes // ALIGN) * ALIGN
    end = max(end, ALIGN)
    cuda = device.type == "cuda"
    if staging is None:
        host = torch.from_numpy(np.zeros(end, dtype=np.uint8))
    else:
        buf, slot = staging.take(end)
        host = buf[:end]
    view = host.numpy()
    for a, start in zip(arrays, starts):
        view[start : start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    if staging is None:
        dev = (host.pin_memory() if cuda else host).to(device, non_blocking=True)
    else:  # on the CPU a copy too: the ring's slot is written again later
        dev = host.to(device, non_blocking=True) if cuda else host.clone()
        staging.copied(slot)
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
