"""Page allocation with reference counts and a prefix cache of full pages.

A full page whose KV is computed is registered under (parent page's node id, its tokens). A later
sequence with the same prefix walks that chain from the start and shares the pages (refcount + 1), so
the n samples of a prompt, and later calls with the same prompt, prefill it once. Registered pages are
immutable: a sequence only ever writes to pages it holds alone. Pages no one holds stay cached (LRU)
until the pool needs them or `flush` drops the cache. A salt (a LoRA adapter and its load id) starts a
chain of its own: pages computed under another adapter, or the base model, are never shared.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

Key = tuple[int, tuple[int, ...]]
ROOT = 0


class PageManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True):
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.refs = [0] * num_pages
        # free pages: those never handed out (ids from `_fresh` up, so a reset of a pool of 100k's of
        # pages costs no list of them), then the ones given back, in the order they came back
        self._fresh = 0
        self.free_pages: deque[int] = deque()
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.index: dict[Key, int] = {}  # key -> page
        self.page_key: dict[int, Key] = {}
        self.page_node: dict[int, int] = {}  # page -> node id (never reused, so chains never go stale)
        self._node_ids = itertools.count(1)
        self._roots: dict[Hashable, int] = {}  # salt -> the node id its chains start from

    # -- allocation -------------------------------------------------------------------------------
    def available(self) -> int:
        return self.num_pages - self._fresh + len(self.free_pages) + len(self.evictable)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages (evicting cached ones, oldest first), or None when there are not enough."""
        if n > self.available():
            return None
        pages = []
        for _ in range(n):
            if self._fresh < self.num_pages:
                page, self._fresh = self._fresh, self._fresh + 1
            else:
                page = self.free_pages.popleft() if self.free_pages else self._evict()
            self.refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        # last page first, so a chain's leaves become the oldest and are evicted before their parents
        for page in reversed(pages):
            self.refs[page] -= 1
            assert self.refs[page] >= 0, f"page {page} released twice"
            if self.refs[page] == 0:
                if page in self.page_key:
                    self.evictable[page] = None
                else:
                    self.free_pages.append(page)

    def _evict(self) -> int:
        page, _ = self.evictable.popitem(last=False)
        self._forget(page)
        return page

    def _forget(self, page: int) -> None:
        key = self.page_key.pop(page)
        del self.index[key]
        del self.page_node[page]

    # -- prefix cache -----------------------------------------------------------------------------
    def _root(self, salt: Hashable) -> int:
        if salt is None:
            return ROOT
        if salt not in self._roots:
            self._roots[salt] = next(self._node_ids)
        return self._roots[salt]

    def match(self, tokens: Sequence[int], salt: Hashable = None) -> list[int]:
        """Pages holding the longest cached prefix of `tokens` in whole pages; each gains a reference."""
        if not self.enable_prefix_cache:
            return []
        pages, parent, S = [], self._root(salt), self.page_size
        for start in range(0, len(tokens) - S + 1, S):
            page = self.index.get((parent, tuple(tokens[start : start + S])))
            if page is None:
                break
            pages.append(page)
            parent = self.page_node[page]
        for page in pages:
            if self.refs[page] == 0:
                del self.evictable[page]
            self.refs[page] += 1
        return pages

    def node_of(self, tokens: Sequence[int], salt: Hashable = None) -> int | None:
        """The node of the cached page that ends `tokens` (whole pages), None unless all are cached."""
        node, S = self._root(salt), self.page_size
        for start in range(0, len(tokens), S):
            page = self.index.get((node, tuple(tokens[start : start + S])))
            if page is None:
                return None
            node = self.page_node[page]
        return node

    def register(
        self, pages: Sequence[int], tokens: Sequence[int], done: int, upto: int, salt: Hashable = None
    ) -> int:
        """Index the full pages among the first `upto` computed tokens, past the `done` pages indexed
        already; returns how many of the sequence's pages are indexed now."""
        if not self.enable_prefix_cache:
            return done
        S = self.page_size
        parent = self.page_node.get(pages[done - 1]) if done else self._root(salt)
        if parent is None:  # the cache was flushed under this sequence: its chain is gone
            return done
        for i in range(done, upto // S):
            page = pages[i]
            node = self.page_node.get(page)
            if node is None:
                key = (parent, tuple(tokens[i * S : (i + 1) * S]))
                if key in self.index:  # another sequence cached the same content first: keep theirs
                    return i
                node = next(self._node_ids)
                self.index[key], self.page_key[page], self.page_node[page] = page, key, node
            parent = node
            done = i + 1
        return done

    def forget_salt(self, salt: Hashable) -> int:
        """Drop the cached pages of one salt's chains (a reloaded or unloaded adapter); returns how many.
        Parents are registered before their children, so one pass in index order finds the whole tree."""
        root = self._roots.pop(salt, None)
        if root is None:
            return 0
        nodes, pages = {root}, []
        for (parent, _), page in self.index.items():
            if parent in nodes:
                nodes.add(self.page_node[page])
                pages.append(page)
        for page in pages:
            self._forget(page)
            if page in self.evictable:  # unreferenced: free now; a held page is freed on its release
                del self.evictable[page]
                self.free_pages.append(page)
        return len(pages)

    def flush(self) -> None:
        """Forget every cached prefix (after a weight update the cached KV is stale)."""
        for page in list(self.page_key):
            self._forget(page)
        self.free_pages.extend(self.evictable)
        self.evictable.clear()

    def reset(self) -> None:
        """Forget everything (used when the KV pool is freed and made again)."""
        self.__init__(self.num_pages, self.page_size, self.enable_prefix_cache)
