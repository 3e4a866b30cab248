"""Per-request state beside the paged KV cache, for models that carry one (linear attention).

A recurrent layer keeps a fixed-size state per request instead of a KV entry per token. A model that has
such layers declares it (`state_shapes`: name -> (per-layer, per-request shape, dtype)); the engine then
makes a StatePool of `max_running_requests` slots (+ one scratch slot that CUDA-graph padding rows
write to), sized together with the KV pages and released/resumed with them (the `kv_cache` tag).

A request's slot is handed out the first time it is computed and reclaimed once it finished or lost its
pages (preempted: it recomputes from its first token, and a chunk that starts at token 0 starts from a
zero state, so nothing of the slot's old content is read). The n samples of one prompt copy the
state of the sample that prefilled it (`fork`), see docs/architecture.md.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from rollout.state.sequence import Sequence, Status

StateShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> ((layers, *per request), dtype)


class StatePool:
    def __init__(self, shapes: StateShapes, num_slots: int, device: torch.device):
        self.shapes, self.num_slots, self.device = dict(shapes), num_slots, device
        self.scratch_slot = num_slots
        self.tensors: dict[str, torch.Tensor] | None = None
        self.allocate()

    @staticmethod
    def bytes_per_slot(shapes: StateShapes) -> int:
        return sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in shapes.values())

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot(self.shapes) * (self.num_slots + 1)

    def allocate(self) -> None:
        # [layer, slot, ...]: one layer's states of every slot are one contiguous tensor
        self.tensors = {
            name: torch.zeros((shape[0], self.num_slots + 1, *shape[1:]), dtype=dtype, device=self.device)
            for name, (shape, dtype) in self.shapes.items()
        }

    def free(self) -> None:
        self.tensors = None

    def zero(self) -> None:
        for t in self.tensors.values():
            t.zero_()

    def layer(self, name: str, layer: int) -> torch.Tensor:
        """[slots + 1, *per request] of one layer."""
        return self.tensors[name][layer]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots dst[i] := slots src[i] (int64 device tensors), every layer and tensor."""
        for t in self.tensors.values():
            t[:, dst] = t[:, src]


@dataclass
class StateBatch:
    """A step's view of the state pool: request b of the batch uses slot slots[b]; fresh[b] means its
    chunk starts at token 0 (a zero state, whatever the slot holds)."""

    pool: StatePool
    slots: torch.Tensor  # int64 [B]
    fresh: torch.Tensor  # bool [B]
    q_lens: list[int]
    cu_seqlens: torch.Tensor  # int32 [B + 1]
    decode: bool


class SlotTable:
    """seq_id -> slot, for the requests being computed (at most max_running at a time)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slots: dict[int, tuple[int, Sequence]] = {}
        self._free = list(range(num_slots - 1, -1, -1))

    def slots(self, seqs: list[Sequence]) -> np.ndarray:
        out = np.empty(len(seqs), dtype=np.int64)
        for i, seq in enumerate(seqs):
            entry = self._slots.get(seq.seq_id)
            if entry is None:
                entry = self._assign(seq)
            out[i] = entry[0]
        return out

    def has(self, seq: Sequence) -> bool:
        return seq.seq_id in self._slots

    def _assign(self, seq: Sequence) -> tuple[int, Sequence]:
        if not self._free:
            self._reclaim()
        if not self._free:
            raise RuntimeError(f"no free state slot: more than {self.num_slots} requests computed at once")
        entry = (self._free.pop(), seq)
        self._slots[seq.seq_id] = entry
        return entry

    def _reclaim(self) -> None:
        # a sequence that is not running (finished, preempted, or made up outside the scheduler) holds
        # nothing worth keeping: it starts from token 0, or from a snapshot, when computed again
        for seq_id, (slot, seq) in list(self._slots.items()):
            if seq.status is not Status.RUNNING or not seq.pages:
                del self._slots[seq_id]
                self._free.append(slot)

    def reset(self) -> None:
        self.__init__(self.num_slots)


def snapshot_point(seq: Sequence, page_size: int) -> int:
    """Where the state of a prompt with followers (the other samples of a request) is kept: the last
    page boundary before its last token. The followers share the prompt's pages up to there (the
    prefix cache) and start from this state, so each computes under a page of the prompt, not all of
    it. 0: the prompt is too short to share a page."""
    return (seq.num_prompt - 1) // page_size * page_size


class Snapshots:
    """States of prefixes that end at a cached page, in the pool's snapshot slots (LRU).

    An entry is keyed by the prefix cache's node of the prefix's last page (cache/pages.py), so it is
    valid exactly as long as those pages are cached with that content: a flush (new weights) or an
    eviction gives the pages new nodes, and the old entries are never found again. A snapshot is taken
    while its last page is being filled, before it is indexed: it waits (pending) for the prefix to be
    in the cache, under the sequence's pages or under an equal chain cached before them."""

    def __init__(self, pages, first_slot: int, count: int):
        self.pages = pages  # the engine's PageManager
        self.free = list(range(first_slot + count - 1, first_slot - 1, -1))
        self.by_node: OrderedDict[int, int] = OrderedDict()  # node -> slot, least recently used first
        self.pending: list[tuple[Sequence, int, int, int]] = []  # (seq, prefix length, its last page, slot)

    def take(self, seq: Sequence, upto: int) -> int | None:
        """A slot to keep the state after `seq`'s first `upto` tokens in (evicting the oldest kept one if
        needed); None when every slot waits for its prefix to be cached (the followers then recompute)."""
        self._settle()
        if not self.free and self.by_node:
            _, slot = self.by_node.popitem(last=False)
            self.free.append(slot)
        if not self.free:
            return None
        slot = self.free.pop()
        self.pending.append((seq, upto, seq.pages[upto // self.pages.page_size - 1], slot))
        return slot

    def find(self, page: int) -> int | None:
        """The slot holding the state after the cached prefix that ends with `page`, if any."""
        self._settle()
        node = self.pages.page_node.get(page)
        slot = self.by_node.get(node) if node is not None else None
        if slot is not None:
            self.by_node.move_to_end(node)
        return slot

    def _settle(self) -> None:
        waiting = []
        for seq, upto, page, slot in self.pending:
            node = self.pages.node_of(seq.token_ids[:upto], seq.cache_salt)
            if node is not None:
                old = self.by_node.pop(node, None)
                if old is not None:
                    self.free.append(old)
                self.by_node[node] = slot
            elif self.pages.refs[page] > 0:  # still held by its sequence, not indexed yet
                waiting.append((seq, upto, page, slot))
            else:  # freed without being indexed (the cache is off, or was flushed)
                self.free.append(slot)
        self.pending = waiting

    def clear(self) -> None:
        self.free += list(self.by_node.values()) + [p[-1] for p in self.pending]
        self.by_node.clear()
        self.pending = []
