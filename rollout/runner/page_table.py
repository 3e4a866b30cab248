"""A host-side mirror of every running sequence's page list, so a step's page table is one numpy gather.

Each live sequence owns a row of a numpy table. A step copies only the pages a sequence gained since the
last step (a decode step gains at most one page every page_size tokens), then gathers the batch's rows
in one call. Without it, building the [B, max_pages] table costs B list-to-array copies a step.

A sequence's page list is either extended in place (the scheduler growing it) or replaced by a new list
(freed on preemption or finish, then re-admitted); the row tracks the list object to tell the two apart.
Rows of sequences that finished or lost their pages are reclaimed lazily, when no free row is left.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollout.state.sequence import Sequence, Status


@dataclass
class _Row:
    index: int
    seq: Sequence
    pages: list[int]  # the list object mirrored (identity tells a replaced list from a grown one)
    synced: int  # leading pages already copied into the row


class HostPageTable:
    def __init__(self, num_rows: int, max_pages: int):
        self.table = np.zeros((max(1, num_rows), max(1, max_pages)), dtype=np.int32)
        self._rows: dict[int, _Row] = {}  # seq_id -> its row
        self._free = list(range(self.table.shape[0] - 1, -1, -1))

    def rows(self, seqs: list[Sequence]) -> np.ndarray:
        """int64 [B]: the row of each sequence, after copying in the pages it gained."""
        out = np.empty(len(seqs), dtype=np.int64)
        for i, seq in enumerate(seqs):
            row = self._rows.get(seq.seq_id)
            pages = seq.pages
            if row is None:
                row = self._assign(seq)
            if row.pages is not pages or len(pages) < row.synced:
                row.seq, row.pages, row.synced = seq, pages, 0
            n = len(pages)
            if n != row.synced:
                if n > self.table.shape[1]:
                    self._widen(n)
                self.table[row.index, row.synced : n] = pages[row.synced :]
                row.synced = n
            out[i] = row.index
        return out

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """int32 [B, width]: the page tables of `rows` (entries past a sequence's pages are stale)."""
        if width > self.table.shape[1]:
            self._widen(width)
        return self.table[rows, :width]

    def _assign(self, seq: Sequence) -> _Row:
        if not self._free:
            self._reclaim()
        if not self._free:
            self._grow()
        row = _Row(self._free.pop(), seq, seq.pages, 0)
        self._rows[seq.seq_id] = row
        return row

    def _reclaim(self) -> None:
        # amortised O(1): runs once per table's worth of admissions. A finished sequence, or one whose
        # pages were freed (preempted), mirrors nothing worth keeping.
        for seq_id, row in list(self._rows.items()):
            if row.seq.status is Status.FINISHED or not row.seq.pages:
                del self._rows[seq_id]
                self._free.append(row.index)

    def _grow(self) -> None:
        old = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _widen(self, width: int) -> None:
        pad = max(width, 2 * self.table.shape[1]) - self.table.shape[1]
        self.table = np.pad(self.table, ((0, 0), (0, pad)))
