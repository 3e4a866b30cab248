"""Continuous batching: which sequences run this step, and how many tokens each computes.

A step is either a prefill step (chunks of prompts under a token budget, partial prefills first) or a
decode step (one token for every running sequence). Prefill goes first, so new requests join between
decode steps; with `mixed` (the default), a prefill step also carries one token of every running
sequence that decodes, so requests arriving one by one (a server's) do not stall the others' decoding
for a step each. When the pool runs out of pages the newest running sequence is preempted: its pages
are freed and it waits to be recomputed from its tokens later; it is never dropped.

A step is accounted in two halves, so the engine may launch the next step before this one's tokens are
back (docs/architecture.md, "The step pipeline"). `account`, once the step is launched, counts the
computed tokens, indexes filled pages and appends a PENDING placeholder for each token the step
samples: lengths, positions and page needs are then right for scheduling the next step. `postprocess`,
once the tokens are back, puts them in place of the placeholders, checks stops, and finishes and frees
what ended. The scheduler owns the requests in flight: they leave it when finished or aborted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from rollout.cache.pages import PageManager
from rollout.engine.stop import StopChecker
from rollout.runner.batch import StepOutput
from rollout.runner.state_slots import Snapshots, snapshot_point
from rollout.state.scheduled import ScheduledBatch
from rollout.state.sequence import PENDING, Request, Sequence, Status

if TYPE_CHECKING:
    from rollout.cache.routes import RouteStore


class Scheduler:
    def __init__(
        self,
        pages: PageManager,
        stops: StopChecker,
        *,
        max_running: int,
        max_prefill_tokens: int,
        mixed: bool = True,
        snapshots: Snapshots | None = None,
        routes: RouteStore | None = None,
    ):
        self.pages, self.stops, self.routes = pages, stops, routes
        # a model with per-request state: a cached prefix is shared only where its state was kept
        self.snapshots = snapshots
        self.max_running, self.max_prefill_tokens, self.mixed = max_running, max_prefill_tokens, mixed
        self.requests: dict[Hashable, Request] = {}  # in flight
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # set by retract_all until the next batch runs: the requests in flight hold no KV, so the engine
        # may change weights or memory under them (they recompute their KV when they resume)
        self.retracted = False
        # (sequence, slots) of routes to read before any slot is reused: postprocess reads the ones of
        # every sequence it finishes at once (None outside postprocess: read at once)
        self._route_reads: list[tuple[Sequence, np.ndarray]] | None = None

    def add(self, request: Request) -> None:
        """Queue a request; its first sample prefills the prompt, the others then share its pages."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        leader, *followers = request.seqs
        leader.followers = followers
        self.requests[request.request_id] = request
        self.waiting.append(leader)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- schedule ---------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch; None when nothing can run, or nothing can run until the tokens of the
        step in flight are back (then the engine collects them and asks again)."""
        while self.has_work():
            batch = self._prefill_batch() or self._decode_batch()
            if batch is not None:
                self.retracted = False
                return batch
            if self._awaits_results():
                return None
            if not self.running:
                raise RuntimeError("the KV pool cannot hold a single waiting request; raise max_total_tokens")
            self._preempt(self.running[-1])
        return None

    def _awaits_results(self) -> bool:
        """Whether what blocks scheduling is a step in flight: a sequence that ends with it (its pages
        are freed once it is collected), or a preempted one whose last token is still on its way."""
        return any(_ends_in_flight(s) for s in self.running) or bool(self.waiting and self.waiting[0].pending)

    def _prefill_batch(self) -> ScheduledBatch | None:
        budget, seqs, chunks, decoding = self.max_prefill_tokens, [], [], []
        for seq in self.running:  # finish prefills already under way first (their pages are reserved)
            if seq.needs > 1 and budget > 0:
                chunk = self._chunk(seq, budget)
                seqs.append(seq), chunks.append(chunk)
                budget -= chunk
            elif seq.needs == 1:
                decoding.append(seq)
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if seq.pending or not self._admit(seq):  # pending: its prompt would hold the placeholder
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunk = self._chunk(seq, budget)
            seqs.append(seq), chunks.append(chunk)
            budget -= chunk
        if not seqs:
            return None
        # the decoding sequences ride along, past the budget (one token each); one without a page to grow
        # into waits for the next decode step, which preempts to make room
        riders = [s for s in decoding if not _ends_in_flight(s) and self._grow(s)] if self.mixed else []
        return ScheduledBatch(seqs + riders, chunks + [1] * len(riders), decode=False, decodes=len(riders))

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` computes this step. With per-request state, a prompt whose followers will share
        it stops at its snapshot point once, so that the state there can be kept (cache/state.py)."""
        chunk = min(seq.needs, budget)
        if self.snapshots is not None and seq.followers:
            point = snapshot_point(seq, self.pages.page_size)
            if seq.num_computed < point:
                chunk = min(chunk, point - seq.num_computed)
        return chunk

    def _admit(self, seq: Sequence) -> bool:
        """Reserve pages for all of `seq`'s tokens, keeping one spare page per running sequence so the
        next decode step does not preempt what was just admitted."""
        self._attach_cached_prefix(seq)
        missing = -(-seq.num_tokens // self.pages.page_size) - len(seq.pages)
        if missing > self.pages.available() - len(self.running):
            self._free(seq)
            return False
        seq.pages += self.pages.allocate(missing)
        return True

    def _decode_batch(self) -> ScheduledBatch | None:
        seqs, i = [], 0
        while i < len(self.running):
            seq = self.running[i]
            if _ends_in_flight(seq):  # nothing more to compute for it
                i += 1
                continue
            if self._grow(seq):
                seqs.append(seq)
                i += 1
                continue
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                break
        return ScheduledBatch(seqs, [1] * len(seqs), decode=True) if seqs else None

    def _attach_cached_prefix(self, seq: Sequence) -> None:
        if seq.pages:
            return
        pages = self.pages.match(seq.token_ids, seq.cache_salt)
        # keep at least one token to compute (its logits give the next token); drop the whole last page
        # rather than recompute into a shared page
        if len(pages) * self.pages.page_size >= seq.num_tokens:
            self.pages.release(pages[-1:])
            pages = pages[:-1]
        if seq.scoring is not None:  # the logits from position scoring.start - 1 on are wanted
            keep = (seq.scoring.start - 1) // self.pages.page_size
            self.pages.release(pages[keep:])
            pages = pages[:keep]
        if self.snapshots is not None and pages:  # the state after the prefix must be kept, or no sharing
            seq.state_from = self.snapshots.find(pages[-1])
            if seq.state_from is None:
                self.pages.release(pages)
                pages = []
        seq.pages, seq.num_indexed_pages = pages, len(pages)
        seq.num_computed = len(pages) * self.pages.page_size

    def _grow(self, seq: Sequence) -> bool:
        """Make room for one more token of `seq`; False when the pool has no page left."""
        if seq.num_computed < len(seq.pages) * self.pages.page_size:
            return True
        page = self.pages.allocate(1)
        if page is None:
            return False
        seq.pages += page
        return True

    def _free(self, seq: Sequence) -> None:
        if self.routes is not None and seq.params.return_routed_experts:
            self._keep_routes(seq)
        self.pages.release(seq.pages)
        seq.pages, seq.num_computed, seq.num_indexed_pages = [], 0, 0
        seq.state_from = None

    def _keep_routes(self, seq: Sequence) -> None:
        """Read the routes of the computed tokens not read yet, before their slots go: a preempted
        sequence keeps the routes of the forward that produced its tokens, not its recomputation's."""
        start, end = seq.num_routes, seq.num_computed
        if end <= start:
            return
        size = self.pages.page_size
        pos = np.arange(start, end)
        slots = np.asarray(seq.pages, dtype=np.int64)[pos // size] * size + pos % size
        seq.num_routes = end
        if self._route_reads is not None:
            self._route_reads.append((seq, slots))
        else:
            seq.routes.append(self.routes.read(slots))

    def _read_deferred_routes(self) -> None:
        reads, self._route_reads = self._route_reads, None
        if reads:
            for (seq, _), rows in zip(reads, self.routes.read_many([slots for _, slots in reads])):
                seq.routes.append(rows)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def retract_all(self) -> int:
        """Preempt every running sequence (newest first, so the oldest resumes first): all pages of the
        requests in flight are freed, and they resume from their tokens. Returns how many were running."""
        count = len(self.running)
        while self.running:
            self._preempt(self.running[-1])
        self.num_preemptions -= count  # asked for, not forced by a full pool
        self.retracted = True
        return count

    def holds_no_kv(self) -> bool:
        """Whether the requests in flight were retracted and hold no pages since."""
        return self.retracted and not self.running

    # -- after the model ran ----------------------------------------------------------------------
    def account(self, batch: ScheduledBatch, sampled: list[int]) -> list[Sequence | None]:
        """Count a launched step's computed chunks and index the pages they filled; each sequence at
        batch row `sampled[i]` gets a PENDING placeholder for the token it samples. Returns, per sampled
        row, its sequence, or None when it finished while the step was in flight (its token is
        discarded). Called once the step before it is collected, so every computed token is known and
        the next schedule sees what it would without overlap (filled pages, released followers)."""
        S = self.pages.page_size
        for seq, chunk in zip(batch.seqs, batch.chunks):
            if seq.status is Status.FINISHED:
                continue
            seq.num_computed += chunk
            if seq.num_computed // S > seq.num_indexed_pages:  # a page was filled: index it
                seq.num_indexed_pages = self.pages.register(
                    seq.pages, seq.token_ids, seq.num_indexed_pages, seq.num_computed, seq.cache_salt
                )
        rows: list[Sequence | None] = []
        for i in sampled:
            seq = batch.seqs[i]
            if seq.status is Status.FINISHED:
                rows.append(None)
                continue
            rows.append(seq)
            if seq.followers:  # the prompt is cached now: its siblings go next, sharing it
                self.waiting.extendleft(reversed(seq.followers))
                seq.followers = []
            if seq.scoring is None or not seq.scoring.only:
                seq.token_ids.append(PENDING)
                seq.pending = True
        return rows

    def postprocess(
        self,
        batch: ScheduledBatch,
        rows: list[Sequence | None],
        out: StepOutput | None,
        weight_version: int = 0,
    ) -> list[Request]:
        """Once an accounted step's results are back: put each sampled token (with the `weight_version`
        that sampled it) in place of its placeholder, finish what stopped. Returns the requests that
        gained a token (finished ones have left the scheduler)."""
        self._route_reads = []  # no slot is allocated until this returns: the reads can wait till then
        try:
            return self._postprocess(batch, rows, out, weight_version)
        finally:
            self._read_deferred_routes()

    def _postprocess(
        self, batch: ScheduledBatch, rows: list[Sequence | None], out: StepOutput | None, weight_version: int
    ) -> list[Request]:
        touched: dict[Hashable, Request] = {}
        if out is not None and out.prompt:
            _add_prompt_logprobs(batch, out.prompt)
        for i, seq in enumerate(rows):
            if seq is None or seq.status is Status.FINISHED:
                continue
            if seq.scoring is not None and seq.scoring.only:  # Engine.score: all in, nothing to sample
                self._finish(seq)
                touched[seq.request_id] = self.requests[seq.request_id]
                continue
            seq.token_ids[-1] = out.tokens[i]
            seq.pending = False
            seq.weight_versions.append(weight_version)
            if seq.params.logprobs:
                seq.logprobs.append(out.logprobs[i])
            if seq.params.top_logprobs:
                seq.top_logprobs.append(dict(list(out.top[i].items())[: seq.params.top_logprobs]))
            if seq.params.sample_ranks:
                seq.logprob_ranks.append(out.ranks[i])
            if self.stops.check(seq):
                self._finish(seq)
            touched[seq.request_id] = self.requests[seq.request_id]
        for rid, req in touched.items():
            if req.finished:
                del self.requests[rid]
        return list(touched.values())

    def _finish(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:  # preempted while its last token was in flight
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED

    # -- aborts -----------------------------------------------------------------------------------
    def abort(self, request_id: Hashable) -> Request | None:
        """End a request in flight (finish_reason "abort", tokens so far kept); None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        live = set(req.seqs)
        self.running = [s for s in self.running if s not in live]
        self.waiting = deque(s for s in self.waiting if s not in live)
        for seq in req.seqs:
            if seq.pending:  # its token in flight is never reported
                seq.token_ids.pop()
                seq.pending = False
            if seq.status is not Status.FINISHED:
                self._free(seq)
                seq.followers = []
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
        return req

    def abort_all(self) -> list[Request]:
        """Abort every request in flight (their pages are freed); returns them."""
        return [self.abort(rid) for rid in list(self.requests)]


def _ends_in_flight(seq: Sequence) -> bool:
    """Whether the step in flight ends `seq` whatever it samples: a score (nothing to sample after its
    prefill) or a sample at max_new_tokens once its pending token lands."""
    return seq.needs == 0 or (seq.pending and seq.num_output >= seq.params.max_new_tokens)


def _add_prompt_logprobs(batch: ScheduledBatch, pieces: dict) -> None:
    """Store the logprobs of given tokens a prefill chunk computed. A preempted sequence recomputes
    from its start: its pieces overwrite what it had from there on (the same values)."""
    for i, piece in pieces.items():
        seq = batch.seqs[i]
        scoring = seq.scoring
        keep = piece.first - scoring.start
        del scoring.logprobs[keep:], scoring.top[keep:], scoring.ranks[keep:]
        scoring.logprobs += piece.logprobs
        if piece.ranks is not None:
            scoring.ranks += piece.ranks
        if piece.top is not None:
            scoring.top += piece.top
