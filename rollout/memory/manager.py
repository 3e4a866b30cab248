"""The engine's release/resume state machine: which tags are released, and what each one does.

It owns the engine's device memory by tag: the model's tensors ("weights"), the KV pool ("kv_cache")
and the captured decode graphs ("cuda_graph"). Each tag has one release and one resume action, in one
table. Without a saver the same state machine runs: the KV pool is freed and made again on a CPU, and
released weights are overwritten with NaN (their storage stays, since modules and the trainer's views
hold references to it), so stale use is loud rather than silently wrong.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollout.cache.pool import KVPool
from rollout.cache.state import StatePool
from rollout.memory.host_copy import HostCopy
from rollout.memory.saver import TAGS, MemorySaver

log = logging.getLogger("rollout.memory")


@dataclass(frozen=True)
class TagActions:
    release: Callable[[], int]  # returns the bytes given back
    resume: Callable[[], int]  # returns the bytes taken back


class MemoryManager:
    def __init__(
        self,
        saver: MemorySaver,
        device: torch.device,
        model: torch.nn.Module,
        kv: KVPool,
        state: StatePool | None = None,
    ):
        self.saver, self.device, self.model, self.kv = saver, device, model, kv
        self.state = state  # per-request state slots, released and resumed with the KV pages
        self._released: set[str] = set()
        self._params_copy: HostCopy | None = None
        self._buffers_copy: HostCopy | None = None  # buffers (rotary tables) no trainer sends: always kept
        self._keep_params = False
        self._paused_bytes: dict[str, int] = {}  # what each paused tag gave back
        self._warned_no_saver = False
        self._actions = {
            "weights": TagActions(self._release_weights, self._resume_weights),
            "kv_cache": TagActions(self._release_kv_cache, self._resume_kv_cache),
            "cuda_graph": TagActions(self._pause_only("cuda_graph"), self._resume_only("cuda_graph")),
        }

    @property
    def released(self) -> frozenset[str]:
        return frozenset(self._released)

    @property
    def paused_bytes(self) -> dict[str, int]:
        """Bytes each tag gave back at its last pause (a GPU with a memory saver)."""
        return dict(self._paused_bytes)

    def check_resident(self, action: str) -> None:
        released = [t for t in TAGS if t in self._released]
        if released:
            raise RuntimeError(
                f"{action}: the engine's memory is released ({', '.join(released)}); "
                "call resume_memory_occupation() first"
            )

    def check_weights_resident(self, action: str) -> None:
        if "weights" in self._released:
            raise RuntimeError(
                f"{action}: the weights are released; call resume_memory_occupation(tags=['weights']) first"
            )

    # -- release / resume -------------------------------------------------------------------------
    def release(self, tags: list[str], *, keep_weights_backup: bool) -> None:
        """Release `tags` (TAGS order); tags released already are skipped."""
        todo = self._todo(tags, "release", want_released=False)
        if not todo:
            return
        self._keep_params = keep_weights_backup
        self._run(todo, "released", lambda tag: self._actions[tag].release(), self._released.add)

    def resume(self, tags: list[str]) -> None:
        todo = self._todo(tags, "resume", want_released=True)
        if not todo:
            return
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # an in-process trainer's cached blocks make room first
        self._run(todo, "resumed", self._resume_tag, self._released.discard)

    def _resume_tag(self, tag: str) -> int:
        self._check_room(tag)
        return self._actions[tag].resume()

    def _todo(self, tags: list[str], action: str, *, want_released: bool) -> list[str]:
        todo = [t for t in tags if (t in self._released) == want_released]
        skipped = [t for t in tags if t not in todo]
        if skipped:
            state = "resident" if want_released else "released"
            log.info("%s_memory_occupation: %s already %s, nothing to do for it", action, skipped, state)
        return todo

    def _run(
        self, todo: list[str], verb: str, act: Callable[[str], int], mark: Callable[[str], None]
    ) -> None:
        t0, free0 = time.perf_counter(), self._device_free()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing may still run on memory about to change
        amounts = {}
        try:
            for tag in todo:
                amounts[tag] = act(tag)
                mark(tag)
        finally:
            if verb == "released" and self.device.type == "cuda":
                torch.cuda.empty_cache()  # the engine's cached activations go back too
            self._log(verb, amounts, t0, free0)

    # -- the actions of each tag --------------------------------------------------------------------
    def _release_weights(self) -> int:
        params, buffers = list(self.model.parameters()), list(self.model.buffers())
        self._buffers_copy = _saved(self._buffers_copy, buffers)
        self._params_copy = _saved(self._params_copy, params) if self._keep_params else None
        if self.saver.enabled:
            return self._pause("weights")
        self._warn_no_saver()
        with torch.no_grad():
            for t in params + buffers:
                if t.is_floating_point():
                    t.fill_(float("nan"))
        return 0

    def _resume_weights(self) -> int:
        restored = self._resume("weights") if self.saver.enabled else 0
        with torch.no_grad():
            self._buffers_copy.restore()
            if self._params_copy is not None:
                self._params_copy.restore()
        return restored

    def _release_kv_cache(self) -> int:
        if self.saver.enabled:
            return self._pause("kv_cache")
        if self.device.type == "cpu":
            nbytes = self.kv.nbytes
            self.kv.free()
            if self.state is not None:
                nbytes += self.state.nbytes
                self.state.free()
            return nbytes
        self._warn_no_saver()  # CUDA graphs may hold the pool's address: keep it
        return 0

    def _resume_kv_cache(self) -> int:
        if self.saver.enabled:
            restored = self._resume("kv_cache")
            self.kv.data.zero_()  # resumed pages hold arbitrary bit patterns (NaN included)
            if self.state is not None:
                self.state.zero()
            return restored
        restored = 0
        if self.kv.data is None:
            self.kv.allocate()
            restored += self.kv.nbytes
        if self.state is not None and self.state.tensors is None:
            self.state.allocate()
            restored += self.state.nbytes
        return restored

    def _pause_only(self, tag: str) -> Callable[[], int]:
        return lambda: self._pause(tag) if self.saver.enabled else 0

    def _resume_only(self, tag: str) -> Callable[[], int]:
        return lambda: self._resume(tag) if self.saver.enabled else 0

    # -- device bookkeeping -------------------------------------------------------------------------
    def _pause(self, tag: str) -> int:
        free0 = torch.cuda.mem_get_info(self.device)[0]
        self.saver.pause(tag)
        freed = torch.cuda.mem_get_info(self.device)[0] - free0
        self._paused_bytes[tag] = freed
        return freed

    def _resume(self, tag: str) -> int:
        free0 = torch.cuda.mem_get_info(self.device)[0]
        self.saver.resume(tag)
        return free0 - torch.cuda.mem_get_info(self.device)[0]

    def _check_room(self, tag: str) -> None:
        # torch_memory_saver ends the process when it cannot map the memory back: raise first instead
        need = self._paused_bytes.get(tag, 0) if self.saver.enabled else 0
        if need:
            free = torch.cuda.mem_get_info(self.device)[0]
            if free < need:
                raise RuntimeError(
                    f"resume_memory_occupation: {tag} needs {need / 2**30:.2f} GiB but only "
                    f"{free / 2**30:.2f} GiB of {self.device} is free; free the trainer's memory first "
                    "(drop its tensors, then torch.cuda.empty_cache())"
                )

    def _warn_no_saver(self) -> None:
        if self.device.type == "cuda" and not self._warned_no_saver:
            self._warned_no_saver = True
            log.warning(
                "enable_memory_saver=False: release_memory_occupation frees no GPU memory "
                "(it only invalidates the engine's state)"
            )

    def _device_free(self) -> int | None:
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None

    def _log(self, verb: str, amounts: dict[str, int], t0: float, free0: int | None) -> None:
        ms = (time.perf_counter() - t0) * 1e3
        parts = ", ".join(f"{tag} {n / 2**30:.2f} GiB" for tag, n in amounts.items())
        device = ""
        if free0 is not None:
            device = f"; {self.device} free {free0 / 2**30:.2f} -> {self._device_free() / 2**30:.2f} GiB"
        log.info("%s %s in %.1f ms (%s%s)", verb, list(amounts), ms, parts, device)


def _saved(copy: HostCopy | None, tensors: list[torch.Tensor]) -> HostCopy:
    """`tensors` saved to the host, reusing `copy`'s buffers when it holds the same tensors."""
    if copy is None or not copy.matches(tensors):
        copy = HostCopy(tensors)
    copy.save()
    return copy
