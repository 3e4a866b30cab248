"""Tagged memory regions over torch_memory_saver.

Tensors allocated inside `region(tag)` (and graphs captured inside `cuda_graph(...)`) can be paused:
their physical memory goes back to the device while their virtual addresses stay reserved, so tensors,
and CUDA graphs that baked those addresses in, work again after `resume(tag)` (with new, uninitialised
contents). The disabled saver (CPU, or enable_memory_saver=False) makes every method a cheap no-op.

See docs/memory.md for the staged wake and the interplay with `expandable_segments`.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

log = logging.getLogger("rollout.memory")

TAGS = ("weights", "kv_cache", "cuda_graph")  # also the resume order: a staged wake loads weights first
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

    def resume_if_paused(self, tag: str) -> None:
        """Resume `tag` when it is paused (at shutdown: paused memory cannot be freed)."""


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
        self._paused: set[str] = set()
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
        atexit.register(self._before_teardown)

    def _before_teardown(self) -> None:
        # torch frees the memory-saver pools' blocks while the interpreter shuts down, outside any
        # region, and torch_memory_saver ends the process with status 1 on a free outside a region.
        # From here on this (main) thread counts as inside one, so those frees go through.
        impl = getattr(self._tms, "_impl", None)
        if impl is None:  # its library never started (a stand-in module, as in tests): nothing to free
            return
        cdll = getattr(getattr(impl, "_binary_wrapper", None), "cdll", None)
        if cdll is None or not hasattr(cdll, "tms_set_interesting_region"):
            log.warning("torch_memory_saver has no tms_set_interesting_region: the exit status may be 1")
            return
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError:
            pass  # the device is gone already; nothing to wait for
        cdll.tms_set_interesting_region(True)

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
        self._paused.add(tag)

    def resume(self, tag: str) -> None:
        _check_tag(tag)
        self._tms.resume(tag)
        self._paused.discard(tag)

    def resume_if_paused(self, tag: str) -> None:
        if tag in self._paused:
            self.resume(tag)


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
