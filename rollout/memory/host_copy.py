"""Host copies of device tensors, kept across release/resume cycles."""

from __future__ import annotations

import torch


class HostCopy:
    """Host copies of some tensors in one flat buffer (pinned for a GPU), reused from cycle to cycle."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // 64) * 64  # 64-byte aligned views
        pin = bool(tensors) and tensors[0].is_cuda
        flat = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        self.copies = [
            flat[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for o, t in zip(offsets, tensors)
        ]
        self.nbytes = total

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        return len(tensors) == len(self.tensors) and all(a is b for a, b in zip(tensors, self.tensors))

    def save(self) -> None:
        for copy, t in zip(self.copies, self.tensors):
            copy.copy_(t, non_blocking=True)
        if self.tensors and self.tensors[0].is_cuda:
            torch.cuda.synchronize(self.tensors[0].device)  # the device memory goes away right after

    def restore(self) -> None:
        # later kernels on this stream run after the copies; the host buffers stay alive in self.copies
        for t, copy in zip(self.tensors, self.copies):
            t.copy_(copy, non_blocking=True)
