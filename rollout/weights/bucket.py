"""Flattened buckets: many named tensors in one contiguous byte buffer plus per-tensor metadata.

One buffer crosses a process boundary (one IPC handle, one broadcast) instead of hundreds. The layout
is tensors back to back with no padding, the layout SGLang's `FlattenedTensorBucket` uses, so a
receiver can rebuild it from (names, dtypes, shapes) alone and a trainer written for SGLang packs the
same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a bucket's buffer: `offset` and `nbytes` are in bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass
class FlattenedBucket:
    """`buffer`: 1-D contiguous uint8 tensor; `metas`: the tensors inside it, in order."""

    buffer: torch.Tensor
    metas: list[TensorMeta]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


# Short and safetensors names, beside torch's own ("bfloat16", "torch.bfloat16", "half"): trainers that
# speak JSON send dtypes as strings, and checkpoint headers name them the safetensors way.
DTYPE_ALIASES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp64": torch.float64,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def parse_dtype(dtype: Any, what: str = "dtype") -> torch.dtype:
    """A torch dtype from a torch.dtype or a name: torch's ("bfloat16", "torch.bfloat16"), short ("bf16")
    or safetensors' ("BF16"). The one place dtypes are parsed; anything else is a TypeError."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = DTYPE_ALIASES.get(dtype) or getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    raise TypeError(f"{what}: {dtype!r} is not a torch dtype")


def parse_shape(shape: Any, what: str = "shape") -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        raise TypeError(f"{what}: expected a sequence of ints, got {shape!r}")
    dims = tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"{what}: expected non-negative ints, got {dims!r}")
    return dims


def layout(names: Sequence[str], dtypes: Sequence[Any], shapes: Sequence[Any]) -> list[TensorMeta]:
    """Metadata of tensors packed back to back, in the given order."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    metas, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str):
            raise TypeError(f"weight name must be a str, got {type(name).__name__}")
        meta = TensorMeta(
            name, parse_dtype(dtype, f"dtype of {name!r}"), parse_shape(shape, f"shape of {name!r}"), offset
        )
        metas.append(meta)
        offset = meta.end
    return metas


def total_bytes(metas: Sequence[TensorMeta]) -> int:
    return max((m.end for m in metas), default=0)


def empty_buffer(nbytes: int, device: torch.device | str = "cpu", shared: bool = False) -> torch.Tensor:
    """A uint8 buffer; `shared` puts a CPU buffer in shared memory so another process can map it."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf.share_memory_() if shared and buf.device.type == "cpu" else buf


@torch.no_grad()
def pack(
    named: Sequence[tuple[str, torch.Tensor]],
    *,
    out: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> FlattenedBucket:
    """Copy (name, tensor) pairs into one buffer (`out` when given, its first bytes used), casting to
    `dtype` when given. The bucket's buffer is a view of exactly the packed bytes."""
    if not named:
        raise ValueError("cannot pack an empty list of tensors")
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight {name!r} must be a torch.Tensor, got {type(t).__name__}")
    metas = layout([n for n, _ in named], [dtype or t.dtype for _, t in named], [t.shape for _, t in named])
    size = total_bytes(metas)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, device=device or named[0][1].device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous() or out.numel() < size:
        raise ValueError(f"out must be a contiguous 1-D uint8 tensor of at least {size} bytes")
    buffer = out[:size]
    for meta, (_, t) in zip(metas, named):
        write(buffer, meta, t)
    return FlattenedBucket(buffer, metas)


def write(buffer: torch.Tensor, meta: TensorMeta, t: torch.Tensor) -> None:
    """Copy `t` (cast to meta.dtype) into its place in `buffer`."""
    if tuple(t.shape) != meta.shape:
        raise ValueError(f"weight {meta.name!r} has shape {tuple(t.shape)}, its slot expects {meta.shape}")
    dst = buffer[meta.offset : meta.end]
    if meta.offset % meta.dtype.itemsize == 0:
        dst.view(meta.dtype).view(meta.shape).copy_(t)  # one kernel, casting on the way
    else:  # a misaligned slot cannot be viewed as meta.dtype: write the bytes
        dst.copy_(t.to(meta.dtype).contiguous().reshape(-1).view(torch.uint8))


def view(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The tensor `meta` describes, as a view of `buffer` (a copy when its offset is misaligned)."""
    raw = buffer[meta.offset : meta.end]
    if meta.offset % meta.dtype.itemsize:
        raw = raw.clone()  # reinterpreting bytes needs an offset aligned to the element size
    return raw.view(meta.dtype).view(meta.shape)


def validate(bucket: FlattenedBucket) -> list[TensorMeta]:
    """Check the buffer and metadata agree: types, bounds, no overlap. Raises TypeError/ValueError.
    Returns the metadata with dtypes and shapes parsed (a TensorMeta may name its dtype as a string)."""
    buf = bucket.buffer
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"bucket buffer must be a torch.Tensor, got {type(buf).__name__}")
    if buf.layout != torch.strided or buf.is_meta:  # a sparse or meta buffer has no bytes to view
        raise TypeError(
            f"bucket buffer must be a dense tensor with data, got layout {buf.layout} on {buf.device}"
        )
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            "bucket buffer must be a contiguous 1-D uint8 tensor, "
            f"got {buf.dtype} with shape {tuple(buf.shape)}"
        )
    if not isinstance(bucket.metas, (list, tuple)) or not bucket.metas:
        raise ValueError("bucket metadata must be a non-empty list of TensorMeta")
    metas = [_parsed(m) for m in bucket.metas]
    for m in metas:
        if m.end > buf.numel():
            raise ValueError(
                f"bucket entry {m.name!r} spans bytes [{m.offset}, {m.end}) beyond the buffer's {buf.numel()}"
            )
    spans = sorted((m.offset, m.end, m.name) for m in metas if m.nbytes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"bucket entries {a!r} and {b!r} overlap")
    return metas


def _parsed(m: Any) -> TensorMeta:
    if not isinstance(m, TensorMeta):
        raise TypeError(f"bucket metadata entries must be TensorMeta, got {type(m).__name__}")
    if not isinstance(m.name, str):
        raise TypeError(f"bucket entry name must be a str, got {type(m.name).__name__}")
    shape = parse_shape(m.shape, f"shape of {m.name!r}")
    dtype = parse_dtype(m.dtype, f"dtype of {m.name!r}")
    if not isinstance(m.offset, int) or isinstance(m.offset, bool) or m.offset < 0:
        raise ValueError(f"bucket entry {m.name!r}: offset must be a non-negative int, got {m.offset!r}")
    return TensorMeta(m.name, dtype, shape, m.offset)


def unpack(bucket: FlattenedBucket) -> list[tuple[str, torch.Tensor]]:
    """Validate, then return (name, view) pairs over the bucket's buffer."""
    return [(m.name, view(bucket.buffer, m)) for m in validate(bucket)]


def from_sglang(obj: Any) -> FlattenedBucket:
    """Accept SGLang's form, {"flattened_tensor": uint8 buffer, "metadata": [...]}, whose entries carry
    name, shape, dtype and byte offsets start_idx/end_idx."""
    try:
        buffer, entries = obj["flattened_tensor"], obj["metadata"]
    except (KeyError, TypeError):
        raise TypeError(
            "a flattened bucket must be a FlattenedBucket or a dict with keys "
            "'flattened_tensor' and 'metadata'"
        ) from None
    metas = []
    for e in entries:
        get = e.get if isinstance(e, dict) else lambda k, e=e: getattr(e, k, None)
        name = get("name")
        meta = _parsed(TensorMeta(name, get("dtype"), get("shape"), get("start_idx")))
        if get("end_idx") != meta.end:
            raise ValueError(
                f"bucket entry {name!r}: end_idx {get('end_idx')} != start_idx + nbytes ({meta.end})"
            )
        metas.append(meta)
    return FlattenedBucket(buffer, metas)


def as_bucket(obj: Any) -> FlattenedBucket:
    return obj if isinstance(obj, FlattenedBucket) else from_sglang(obj)
