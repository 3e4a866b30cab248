"""Copy plans: where every tensor of an update goes, worked out once per update signature.

A trainer sends the same names, shapes and dtypes at every sync. Resolving the names, checking shapes and
dtypes and making the destination views cost microseconds of Python per tensor, which at a few hundred
tensors is many times the copy itself. A plan does that work once; an update whose signature (names,
shapes, dtypes, devices, tensor types, or a bucket's metadata) equals a cached plan's is already
validated, so it only runs the batched finite check and the copy: one multi-tensor copy for a list, and
for a bucket whose bytes are laid out as the engine's weight storage, one copy per contiguous run.

A plan is built by full validation and cached only when that succeeds, so a refused update writes
nothing and is refused again next time, with the same message.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import nn

from rollout.weights.bucket import FlattenedBucket, TensorMeta, validate, view
from rollout.weights.loader import Named, TensorPlan, max_abs, reducible

MAX_PLANS = 64  # one per bucket of a sync (a 7B model in 128 MB buckets has about 120)


@dataclass(frozen=True)
class Run:
    """Bucket bytes [start, start + nbytes) are engine storage bytes [dst_start, dst_start + nbytes),
    all of one dtype."""

    start: int
    dst_start: int
    nbytes: int
    dtype: torch.dtype


@dataclass
class BucketPlan:
    """How to load a bucket of one metadata list: byte runs straight into the engine's weight storage
    when its layout matches, else views of the buffer through a TensorPlan."""

    metas: list[TensorMeta]  # parsed
    end: int  # bytes the buffer must hold
    tensors: TensorPlan  # names, the finite check's failure report and the fallback copy
    runs: list[Run] | None
    storage: torch.Tensor | None  # the engine's flat uint8 weight storage the runs write into

    @property
    def names(self) -> list[str]:
        return self.tensors.names

    @classmethod
    def build(cls, model: nn.Module, bucket: FlattenedBucket) -> BucketPlan:
        metas = validate(bucket)
        named = [(m.name, view(bucket.buffer, m)) for m in metas]
        tensors = TensorPlan.build(model, named)
        storage = getattr(model, "weight_storage", None)
        runs = _runs(metas, tensors, storage) if storage is not None else None
        end = max((m.end for m in metas), default=0)
        return cls(metas, end, tensors, runs, storage)

    def run(self, buffer: torch.Tensor, check_finite: bool = True) -> int:
        if self.runs is None:
            return self.tensors.run([view(buffer, m) for m in self.metas], check_finite)
        if check_finite:
            self._check_finite(buffer)
        for r in self.runs:
            self.storage[r.dst_start : r.dst_start + r.nbytes].copy_(buffer[r.start : r.start + r.nbytes])
        return len(self.names)

    def _check_finite(self, buffer: torch.Tensor) -> None:
        """One max-abs per run (a run is one dtype, the engine's); on a failure the per-tensor check
        names the culprits."""
        floats = [r for r in self.runs if r.dtype.is_floating_point]
        if not floats:
            return
        values = [reducible(buffer[r.start : r.start + r.nbytes].view(r.dtype)) for r in floats]
        if not bool(torch.isfinite(max_abs(values)).all()):
            self.tensors.check_finite([view(buffer, m) for m in self.metas])


def _runs(metas: list[TensorMeta], plan: TensorPlan, storage: torch.Tensor) -> list[Run] | None:
    """The bucket as runs of engine storage bytes, or None when some entry is not a plain byte copy
    (a cast, a tensor-parallel slice, an entry the model ignores)."""
    if plan.partial or len(plan.whole) != len(metas):
        return None
    base, size = storage.data_ptr(), storage.numel()
    runs: list[Run] = []
    for meta, dst in zip(metas, plan.dsts):
        offset = dst.data_ptr() - base
        if dst.dtype != meta.dtype or not dst.is_contiguous() or not 0 <= offset <= size - meta.nbytes:
            return None
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.dtype == meta.dtype
            and last.start + last.nbytes == meta.offset
            and last.dst_start + last.nbytes == offset
        ):
            runs[-1] = Run(last.start, last.dst_start, last.nbytes + meta.nbytes, last.dtype)
        else:
            runs.append(Run(meta.offset, offset, meta.nbytes, meta.dtype))
    return runs


# -- the cache -------------------------------------------------------------------------------------
def tensor_signature(named: Named) -> Hashable | None:
    """What a list update's plan depends on; None when it cannot be read cheaply (the full checks then
    say what is wrong)."""
    try:
        return tuple((n, type(t), t.shape, t.dtype, t.device, t.layout) for n, t in named)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def bucket_signature(bucket: FlattenedBucket) -> Hashable | None:
    try:
        key = tuple((m.name, m.dtype, m.shape, m.offset) for m in bucket.metas)
        hash(key)  # a shape given as a list: parse it the long way
    except (AttributeError, TypeError):
        return None
    return key


def check_buffer(buffer: object, end: int) -> None:
    """The checks of bucket.validate that depend on the buffer, not the metadata."""
    if (
        not isinstance(buffer, torch.Tensor)
        or buffer.layout != torch.strided
        or buffer.is_meta
        or buffer.dtype != torch.uint8
        or buffer.dim() != 1
        or not buffer.is_contiguous()
        or buffer.numel() < end
    ):
        raise _BufferMismatch


class _BufferMismatch(Exception):
    """The buffer does not fit the cached plan: validate it the long way, which raises the real error."""


@dataclass
class Prepared:
    """An update checked against its plan, ready to load."""

    plan: TensorPlan | BucketPlan
    payload: list[torch.Tensor] | torch.Tensor  # the tensors in update order, or the bucket's buffer

    @property
    def names(self) -> list[str]:
        return self.plan.names

    def load(self, check_finite: bool = True) -> int:
        return self.plan.run(self.payload, check_finite)


class PlanCache:
    """The last MAX_PLANS plans of one model, most recently used last."""

    def __init__(self, model: nn.Module, size: int = MAX_PLANS):
        self.model, self.size = model, size
        self._plans: OrderedDict[Hashable, TensorPlan | BucketPlan] = OrderedDict()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        """Forget every plan (their views name the current parameter storage)."""
        self._plans.clear()

    def tensors(self, named: Named) -> Prepared:
        key = tensor_signature(named)
        plan = self._get(key)
        if plan is None:
            plan = self._put(key, TensorPlan.build(self.model, named))
        return Prepared(plan, [t for _, t in named])

    def bucket(self, bucket: FlattenedBucket) -> Prepared:
        key = bucket_signature(bucket)
        plan = self._get(key)
        if plan is not None:
            try:
                check_buffer(bucket.buffer, plan.end)
                return Prepared(plan, bucket.buffer)
            except _BufferMismatch:
                pass
        plan = self._put(key, BucketPlan.build(self.model, bucket))
        return Prepared(plan, bucket.buffer)

    def _get(self, key: Hashable | None) -> TensorPlan | BucketPlan | None:
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
            self._plans.move_to_end(key)
        return plan

    def _put(self, key: Hashable | None, plan: TensorPlan | BucketPlan) -> TensorPlan | BucketPlan:
        if key is not None:
            self._plans[key] = plan
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)
        return plan
