"""Which running sequence holds which slot of the per-request state pool (cache/state.py), and the
snapshots that let the n samples of a prompt share its prefill.

A sequence's slot is handed out the first time it is computed and reclaimed once it is no longer
running (finished, or preempted: it recomputes from its first token, and a chunk that starts at token 0
starts from a zero state, so nothing of the slot's old content is read).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from rollout.state.sequence import Sequence, Status


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
