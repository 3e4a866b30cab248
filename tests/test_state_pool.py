"""cache/state.py on its own: state slots per running sequence, and the snapshots of shared prefixes."""

from __future__ import annotations

import pytest
import torch

from rollout.cache.pages import PageManager
from rollout.cache.state import StatePool
from rollout.runner.state_slots import SlotTable, Snapshots, snapshot_point
from rollout.sampling import SamplingParams
from rollout.state.sequence import Sequence, Status

S = 4  # page size


def seq(i: int, tokens: list[int], pages: list[int] | None = None) -> Sequence:
    s = Sequence(i, i, 0, list(tokens), len(tokens), SamplingParams(), 0, status=Status.RUNNING)
    s.pages = pages or []
    return s


def test_slots_are_reused_once_their_sequence_is_done():
    table = SlotTable(2)
    a, b, c = seq(0, [1], [0]), seq(1, [1], [1]), seq(2, [1], [2])
    assert table.slots([a, b]).tolist() == [0, 1]
    assert table.slots([b, a]).tolist() == [1, 0]  # stable
    with pytest.raises(RuntimeError, match="no free state slot"):
        table.slots([c])
    a.status = Status.FINISHED
    assert table.slots([c]).tolist() == [0]
    b.pages = []  # preempted: its pages went, it restarts from token 0
    d = seq(3, [1], [3])
    assert table.slots([d]).tolist() == [1]


def test_pool_layout_copy_and_bytes():
    shapes = {"conv": ((3, 8, 3), torch.float32), "recurrent": ((3, 2, 4, 4), torch.float32)}
    pool = StatePool(shapes, num_slots=5, device=torch.device("cpu"))
    assert pool.layer("recurrent", 1).shape == (6, 2, 4, 4) and pool.scratch_slot == 5
    assert pool.nbytes == 6 * 4 * (3 * 8 * 3 + 3 * 2 * 4 * 4)
    pool.tensors["recurrent"][:, 2] = 7.0
    pool.copy(torch.tensor([2, 2]), torch.tensor([0, 4]))
    assert (pool.tensors["recurrent"][:, [0, 4]] == 7).all() and (pool.tensors["recurrent"][:, 1] == 0).all()


def test_snapshots_follow_the_prefix_cache():
    pages = PageManager(32, S)
    snaps = Snapshots(pages, first_slot=10, count=2)
    tokens = list(range(11))
    leader = seq(0, tokens, pages.allocate(3))
    point = snapshot_point(leader, S)
    assert point == 8  # the last page boundary before the last token
    slot = snaps.take(leader, point)
    assert slot in (10, 11)
    assert snaps.find(leader.pages[1]) is None  # not indexed yet: pending
    pages.register(leader.pages, tokens, 0, 8)
    assert snaps.find(leader.pages[1]) == slot
    # a follower attaches the cached pages and finds the same state
    follower_pages = pages.match(tokens[:8])
    assert snaps.find(follower_pages[-1]) == slot
    pages.release(follower_pages)
    pages.flush()  # new weights: the cached prefix and its state are gone
    assert snaps.find(leader.pages[1]) is None


def test_snapshot_slots_run_out_gracefully():
    pages = PageManager(32, S)
    snaps = Snapshots(pages, first_slot=0, count=1)
    a, b = seq(0, list(range(9)), pages.allocate(3)), seq(1, list(range(50, 59)), pages.allocate(3))
    assert snaps.take(a, 8) == 0
    assert snaps.take(b, 8) is None  # the only slot waits for a's prefix to be cached
    pages.register(a.pages, a.token_ids, 0, 8)
    assert snaps.take(b, 8) == 0  # a's is kept now, and the oldest kept one is evicted for b
    assert snaps.find(a.pages[1]) is None
