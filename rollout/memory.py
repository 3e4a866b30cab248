"""Give the GPU back to the trainer: tagged memory regions, and the engine's release/resume state machine.

Two layers:
- `MemorySaver` adapts torch_memory_saver. Tensors allocated inside `region(tag)` (and graphs captured
  inside `cuda_graph(...)`) can be paused: their physical memory goes back to the device while their
  virtual addresses stay reserved, so tensors, and CUDA graphs that baked those addresses in, work again
  after `resume(tag)` (with new, uninitialised contents). The disabled saver (CPU, or
  enable_memory_saver=False) makes every method a cheap no-op.
- `MemoryMixin` gives Engine `release_memory_occupation` / `resume_memory_occupation` and the checks
  that keep a released engine from producing garbage. Without a saver the same state machine runs: the
  KV pool is freed and made again on a CPU, and released weights are overwritten with NaN (their storage
  stays, since modules and the trainer's views hold references to it).

See docs/memory.md for the staged wake and the interplay with `expandable_segments`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("rollout.memory")

TAGS = ("weights", "kv_cache", "cuda_graph")
RESUME_ORDER = TAGS  # weights first: a staged wake loads them before the large KV pool comes back
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_PRELOAD_LIB = "torch_memory_saver_hook_mode_preload"


def check_tags(tags: str | Iterable[str] | None) -> list[str]:
    """The tags to act on, in TAGS order; None means all. Unknown tags raise ValueError naming them."""
    if tags is None:
        return list(TAGS)
    if isinstance(tags, str):
        tags = [tags]
    try:
        wanted = list(tags)
    except TypeError:
        raise TypeError(f"tags must be a list of {list(TAGS)} or None, got {type(tags).__name__}") from None
    unknown = [t for t in wanted if t not in TAGS]
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}; the tags are {list(TAGS)} (None means all)")
    return [t for t in TAGS if t in wanted]


def _check_tag(tag: str) -> None:
    if tag not in TAGS:
        raise ValueError(f"unknown memory tag {tag!r}; the tags are {list(TAGS)}")


def expandable_segments_requested(environ: dict[str, str] | None = None) -> bool:
    """Whether the allocator config in the environment turns PyTorch's expandable segments on."""
    environ = os.environ if environ is None else environ
    for var in ALLOC_CONF_VARS:
        for item in environ.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return True
    return False


# -- the allocator adapter -------------------------------------------------------------------------
class MemorySaver:
    """Tagged memory regions over torch_memory_saver; every method is a cheap no-op when disabled."""

    enabled = False

    def region(self, tag: str) -> AbstractContextManager[None]:
        """Tensors allocated inside belong to `tag`."""
        _check_tag(tag)
        return nullcontext()

    def cuda_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> AbstractContextManager[None]:
        """Capture context for the "cuda_graph" tag (disabled: plain torch.cuda.graph)."""
        return torch.cuda.graph(graph, pool=pool, stream=stream)

    def pause(self, tag: str) -> None:
        _check_tag(tag)

    def resume(self, tag: str) -> None:
        _check_tag(tag)


class CudaMemorySaver(MemorySaver):
    """torch_memory_saver in this process: `hook_mode="torch"` (a pluggable allocator behind per-tag
    MemPools, no LD_PRELOAD), or the preload hook when the process was started with it."""

    enabled = True

    def __init__(self, device: torch.device):
        try:
            import torch_memory_saver
        except ImportError as e:
            raise ImportError(
                "enable_memory_saver=True needs the torch-memory-saver package "
                "(pip install torch-memory-saver, or rollout-engine[gpu])"
            ) from e
        self.device = device
        self._tms = torch_memory_saver.torch_memory_saver
        self._preload = _PRELOAD_LIB in os.environ.get("LD_PRELOAD", "")
        if not self._preload:
            try:
                self._tms.hook_mode = "torch"
            except (AttributeError, AssertionError):
                pass  # already started in this process; its mode stays
        self._expandable = expandable_segments_requested()
        if self._expandable:
            log.warning(
                "expandable_segments is on in PYTORCH_CUDA_ALLOC_CONF: the engine turns it off while it "
                "allocates its weights, KV cache and CUDA graphs, so that they can be released "
                "(see docs/memory.md)"
            )
        with self.region("weights"):  # start torch_memory_saver now, under the same precautions
            pass

    @contextmanager
    def _allocating(self) -> Iterator[None]:
        # PyTorch refuses MemPools with a custom allocator while expandable segments are on, the preload
        # hook does not see their cuMemCreate calls (nothing would be freed), and torch_memory_saver
        # refuses to start when the environment asks for them: turn them off while we allocate.
        if not self._expandable:
            yield
            return
        saved = {var: os.environ[var] for var in ALLOC_CONF_VARS if var in os.environ}
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        for var, value in saved.items():
            os.environ[var] = value.replace("expandable_segments:True", "expandable_segments:False")
        try:
            yield
        finally:
            os.environ.update(saved)
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")

    @contextmanager
    def region(self, tag: str) -> Iterator[None]:
        _check_tag(tag)
        with torch.cuda.device(self.device), self._allocating(), self._tms.region(tag):
            yield

    @contextmanager
    def cuda_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Iterator[None]:
        with torch.cuda.device(self.device), self._allocating():
            if self._preload:
                with self._tms.cuda_graph(graph, pool=pool, stream=stream, tag="cuda_graph"):
                    yield
                return
            # torch_memory_saver's own cuda_graph() needs the preload hook. Here the capture goes to a
            # pool backed by its allocator, inside a "cuda_graph" region that sets the tag (whichever of
            # the two pools PyTorch picks during capture, the memory is tagged and pausable). All
            # captures share that pool, as graphs captured largest-first normally do.
            with self._tms.region("cuda_graph"):
                with torch.cuda.graph(graph, pool=_graph_pool(self.device).id, stream=stream):
                    yield

    def pause(self, tag: str) -> None:
        _check_tag(tag)
        self._tms.pause(tag)

    def resume(self, tag: str) -> None:
        _check_tag(tag)
        self._tms.resume(tag)


# One pool per device for the whole process, never dropped: its blocks come from torch_memory_saver's
# allocator, whose free() ends the process when called outside a region, and PyTorch frees a dead pool's
# blocks at the next empty_cache(). torch_memory_saver keeps its own pools for the same reason.
_GRAPH_POOLS: dict[int, Any] = {}


def _graph_pool(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _GRAPH_POOLS:
        from torch_memory_saver.hooks.mode_torch import HookUtilModeTorch

        _GRAPH_POOLS[index] = torch.cuda.MemPool(allocator=HookUtilModeTorch().get_allocator())
    return _GRAPH_POOLS[index]


def make_memory_saver(enabled: bool, device: torch.device) -> MemorySaver:
    if not enabled:
        return MemorySaver()
    if device.type != "cuda":
        log.info("enable_memory_saver has no effect on %s: release/resume run without freeing memory", device)
        return MemorySaver()
    return CudaMemorySaver(device)


# -- host copies of weights ------------------------------------------------------------------------
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


# -- the engine side -------------------------------------------------------------------------------
@dataclass
class MemoryState:
    released: set[str] = field(default_factory=set)
    missing_weights: set[str] = field(default_factory=set)  # HF names not loaded since a discard
    params_copy: HostCopy | None = None
    buffers_copy: HostCopy | None = None  # buffers (rotary tables) are never sent by a trainer: always kept
    paused_bytes: dict[str, int] = field(default_factory=dict)  # what each paused tag gave back
    warned_no_saver: bool = False


class MemoryMixin:
    """Engine methods to release and resume GPU memory. The Engine sets `memory_saver` and `_memory`
    (a MemoryState) before it builds the model, and provides model, kv, pages, scheduler, device."""

    memory_saver: MemorySaver
    _memory: MemoryState

    @property
    def released_tags(self) -> frozenset[str]:
        """The memory tags released now."""
        return frozenset(self._memory.released)

    def release_memory_occupation(
        self,
        tags: str | Iterable[str] | None = None,
        *,
        abort: bool = False,
        keep_weights_backup: bool = False,
    ) -> None:
        """Give memory back to the device: "weights", "kv_cache", "cuda_graph" (None: all).

        Refuses while requests are in flight unless `abort=True` aborts them. The KV content and the
        prefix cache are dropped. Weights are discarded (the trainer pushes new ones before the next
        generate) unless `keep_weights_backup=True` keeps a host copy that resume restores.
        """
        wanted = check_tags(tags)
        if self.scheduler.has_work():
            if not abort:
                raise RuntimeError(
                    "release_memory_occupation: requests are still in flight; let them finish, "
                    "or pass abort=True to abort them"
                )
            aborted = self.scheduler.abort_all()
            log.warning("release_memory_occupation aborted %d in-flight sequences", len(aborted))
        todo = self._skip_done(wanted, "release", already=True)
        if not todo:
            return
        t0, free0 = time.perf_counter(), self._device_free()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing may still run on memory about to go
        freed = {}
        try:
            for tag in todo:
                freed[tag] = getattr(self, f"_release_{tag}")(keep_weights_backup)
                self._memory.released.add(tag)
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the engine's cached activations go back too
            self._log_memory("released", freed, t0, free0)

    def resume_memory_occupation(self, tags: str | Iterable[str] | None = None) -> None:
        """Take released memory back (None: all). Resuming only "weights" first, updating them, then
        the rest keeps the peak low (staged wake)."""
        todo = self._skip_done(check_tags(tags), "resume", already=False)
        if not todo:
            return
        t0, free0 = time.perf_counter(), self._device_free()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # an in-process trainer's cached blocks make room first
        restored = {}
        try:
            for tag in RESUME_ORDER:
                if tag in todo:
                    self._check_room(tag)
                    restored[tag] = getattr(self, f"_resume_{tag}")()
                    self._memory.released.discard(tag)
        finally:
            self._log_memory("resumed", restored, t0, free0)
        if "weights" in restored and self._memory.missing_weights:
            log.info("weights resumed without a backup: generate waits for an update of all of them")

    # -- checks ---------------------------------------------------------------------------------
    def _check_ready(self) -> None:
        """Raise instead of generating from released memory or discarded weights."""
        st = self._memory
        if st.released:
            released = ", ".join(t for t in TAGS if t in st.released)
            raise RuntimeError(
                f"cannot generate: the engine's memory is released ({released}); "
                "call resume_memory_occupation() first"
            )
        if st.missing_weights:
            total = len(self.model.hf_names())
            raise RuntimeError(
                "cannot generate: the weights were discarded by release_memory_occupation() and "
                f"{len(st.missing_weights)} of {total} have not been loaded since "
                f"(e.g. {sorted(st.missing_weights)[:3]}); push new weights with update_weights_*, "
                "or release with keep_weights_backup=True"
            )

    def _check_weights_resident(self, action: str, *, valid: bool = False) -> None:
        """For weight updates and reads: the weights must not be released (and, for reads, not
        discarded and still missing)."""
        if "weights" in self._memory.released:
            raise RuntimeError(
                f"{action}: the weights are released; call resume_memory_occupation(tags=['weights']) first"
            )
        if valid and self._memory.missing_weights:
            raise RuntimeError(f"{action}: the weights were discarded and not all updated since")

    def _mark_weights_loaded(self, names: Iterable[str] | None = None) -> None:
        """Weight updates call this after loading `names` (HF names; None: the whole model). Weights
        discarded by a release become valid again once every one of them is loaded."""
        self._check_weights_resident("loading weights")
        missing = self._memory.missing_weights
        if not missing:
            return
        if names is None:
            missing.clear()
        else:
            missing.difference_update(names)
        if not missing:
            log.info("all weights loaded since they were discarded: the engine can generate again")

    # -- release / resume of each tag -----------------------------------------------------------
    def _skip_done(self, wanted: list[str], action: str, *, already: bool) -> list[str]:
        todo = [t for t in wanted if (t in self._memory.released) != already]
        skipped = [t for t in wanted if t not in todo]
        if skipped:
            state = "released" if already else "resident"
            log.info("%s_memory_occupation: %s already %s, nothing to do for it", action, skipped, state)
        return todo

    def _weight_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return list(self.model.parameters()), list(self.model.buffers())

    def _release_weights(self, keep_backup: bool) -> int:
        st = self._memory
        params, buffers = self._weight_tensors()
        if st.buffers_copy is None or not st.buffers_copy.matches(buffers):
            st.buffers_copy = HostCopy(buffers)
        st.buffers_copy.save()
        if keep_backup:
            if st.params_copy is None or not st.params_copy.matches(params):
                st.params_copy = HostCopy(params)
            st.params_copy.save()
        else:
            st.params_copy = None  # its host memory goes too
            st.missing_weights = set(self.model.hf_names())
        if self.memory_saver.enabled:
            return self._pause("weights")
        self._warn_no_saver()
        with torch.no_grad():  # the storage stays: make stale use loud rather than silently wrong
            for t in params + buffers:
                if t.is_floating_point():
                    t.fill_(float("nan"))
        return 0

    def _resume_weights(self) -> int:
        st = self._memory
        restored = self._resume("weights") if self.memory_saver.enabled else 0
        with torch.no_grad():
            st.buffers_copy.restore()
            if st.params_copy is not None:
                st.params_copy.restore()
        return restored

    def _release_kv_cache(self, keep_backup: bool) -> int:
        self.pages.reset()  # the KV content goes, and with it every cached prefix
        if self.memory_saver.enabled:
            return self._pause("kv_cache")
        if self.device.type == "cpu":
            nbytes = self.kv.nbytes
            self.kv.free()
            return nbytes
        self._warn_no_saver()  # CUDA graphs may hold the pool's address: keep it
        return 0

    def _resume_kv_cache(self) -> int:
        if self.memory_saver.enabled:
            restored = self._resume("kv_cache")
            # the new pages hold whatever was there (NaN bit patterns included); attention multiplies
            # masked-out slots by zero, which only a finite value survives
            self.kv.data.zero_()
            return restored
        if self.kv.data is None:
            self.kv.allocate()
            return self.kv.nbytes
        return 0

    def _release_cuda_graph(self, keep_backup: bool) -> int:
        return self._pause("cuda_graph") if self.memory_saver.enabled else 0

    def _resume_cuda_graph(self) -> int:
        return self._resume("cuda_graph") if self.memory_saver.enabled else 0

    # -- device bookkeeping ---------------------------------------------------------------------
    def _pause(self, tag: str) -> int:
        free0 = torch.cuda.mem_get_info(self.device)[0]
        self.memory_saver.pause(tag)
        freed = torch.cuda.mem_get_info(self.device)[0] - free0
        self._memory.paused_bytes[tag] = freed
        return freed

    def _resume(self, tag: str) -> int:
        free0 = torch.cuda.mem_get_info(self.device)[0]
        self.memory_saver.resume(tag)
        return free0 - torch.cuda.mem_get_info(self.device)[0]

    def _check_room(self, tag: str) -> None:
        # torch_memory_saver ends the process when it cannot map the memory back: raise first instead
        need = self._memory.paused_bytes.get(tag, 0) if self.memory_saver.enabled else 0
        if need:
            free = torch.cuda.mem_get_info(self.device)[0]
            if free < need:
                raise RuntimeError(
                    f"resume_memory_occupation: {tag} needs {need / 2**30:.2f} GiB but only "
                    f"{free / 2**30:.2f} GiB of {self.device} is free; free the trainer's memory first "
                    "(drop its tensors, then torch.cuda.empty_cache())"
                )

    def _warn_no_saver(self) -> None:
        if self.device.type == "cuda" and not self._memory.warned_no_saver:
            self._memory.warned_no_saver = True
            log.warning(
                "enable_memory_saver=False: release_memory_occupation frees no GPU memory "
                "(it only invalidates the engine's state)"
            )

    def _device_free(self) -> int | None:
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None

    def _log_memory(self, action: str, amounts: dict[str, int], t0: float, free0: int | None) -> None:
        ms = (time.perf_counter() - t0) * 1e3
        parts = ", ".join(f"{tag} {n / 2**30:.2f} GiB" for tag, n in amounts.items())
        device = ""
        if free0 is not None:
            device = f"; {self.device} free {free0 / 2**30:.2f} -> {self._device_free() / 2**30:.2f} GiB"
        log.info("%s %s in %.1f ms (%s%s)", action, list(amounts), ms, parts, device)
