"""Weight checksums that both sides of a sync compute the same way, on the device.

The tensor is cut into chunks of CHUNK elements; a chunk's sum is sum_i bits_i * w_i modulo 2**64, where
bits_i is element i's bit pattern read as a signed integer (int16 for 2-byte dtypes, int32 for 4-byte,
int64 for 8-byte) and w_i an odd 64-bit weight mixed from i's position in the chunk; the chunk sums are
chained by an odd multiplier (Horner), and the element count added. Integer arithmetic makes it exact:
equal for bit-identical tensors on any device and in any reduction order. A single changed element
always changes it (its bit difference d is nonzero and below 2**64, and d times a product of odd
numbers is never 0 mod 2**64); several changes cancel with probability about 2**-64.

int64 products and sums wrap on overflow in torch (two's-complement on the CPU and CUDA alike), which
is the modular arithmetic wanted here. The work is chunked so the int64 temporaries stay bounded; the
position weights of one chunk are made once per device and reused.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

CHUNK = 1 << 22  # elements per reduction: 32 MiB of int64 temporaries
MASK = (1 << 64) - 1
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _to_signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_K1, _K2, _K3 = (_to_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _weights(device: torch.device) -> torch.Tensor:
    """Odd position weights for one chunk (splitmix64-like mixing of the index)."""
    w = _WEIGHTS.get(device)
    if w is None:
        x = (torch.arange(CHUNK, dtype=torch.int64, device=device) + 1) * _K1
        x = (x ^ (x >> 30)) * _K2  # arithmetic shifts: fine, both sides run this same code
        x = (x ^ (x >> 27)) * _K3
        w = _WEIGHTS[device] = (x ^ (x >> 31)) | 1
    return w


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as signed integers of the same width (flat)."""
    t = t.detach().contiguous().reshape(-1)
    dtype = _BITS.get(t.element_size())
    if dtype is None:
        raise TypeError(f"cannot checksum a tensor of dtype {t.dtype}")
    return t.view(dtype)


def checksum_device(t: torch.Tensor) -> torch.Tensor:
    """The checksum as a 0-dim int64 tensor on `t`'s device (no host sync)."""
    bits, w = _bits(t), _weights(t.device)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), CHUNK):
        piece = bits[start : start + CHUNK]
        total += (piece.to(torch.int64) * w[: piece.numel()]).sum()
        # shift the weights per chunk, so equal chunks at different offsets do not look alike
        total *= _K1
    return total + t.numel()


def checksums(tensors: Iterable[torch.Tensor]) -> list[int]:
    """One checksum per tensor as an unsigned 64-bit int; one host copy per device at the end."""
    return to_host([checksum_device(t) for t in tensors])


def to_host(sums: list[torch.Tensor]) -> list[int]:
    """checksum_device results as unsigned ints, read with one host copy per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    out = [0] * len(sums)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([sums[i] for i in idx]).tolist()):
            out[i] = v & MASK
    return out


def checksum(t: torch.Tensor) -> int:
    return checksums([t])[0]
