"""The step pipeline: schedule -> launch -> collect, and the overlap state between two calls of `step`.

With overlap, `step` launches the next step before collecting the one in flight, so the host prepares
step k+1 while the device runs step k, and step k's tokens are reported one call late. What a step
reports: the requests a release or update aborted since the last one, outputs collected outside
`step` (before a method that must see every launched step), and the outputs of what it collected.
See docs/architecture.md, "The step pipeline".
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from rollout.engine.results import request_output
from rollout.engine.scheduler import Scheduler
from rollout.outputs import RequestOutput
from rollout.runner.model_runner import Launched, ModelRunner
from rollout.state.scheduled import ScheduledBatch
from rollout.state.sequence import Request, Sequence

TOTALS = ("steps", "prefill_steps", "prefill_tokens", "decode_tokens", "step_seconds")


@dataclass
class InFlight:
    """A launched step not yet collected: its batch, its sampled rows' sequences (None: discarded), the
    runner's handle, and the weight version that computes it."""

    batch: ScheduledBatch
    rows: list[Sequence | None]
    launched: Launched
    weight_version: int


class StepPipeline:
    """Runs the scheduler's batches on the runner, one launched step ahead with overlap."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        tokenizer: Any,
        overlap: bool,
        weight_version: Callable[[], int],
        check_ready: Callable[[str], None],
    ):
        self.scheduler, self.runner, self.tokenizer, self.overlap = scheduler, runner, tokenizer, overlap
        self.weight_version, self.check_ready = weight_version, check_ready
        self.in_flight: InFlight | None = None
        self.collected: list[RequestOutput] = []  # from a step collected outside `step`, not yet reported
        self.aborted: list[Request] = []  # aborted by a release or an update, not yet reported
        self.totals: dict[str, float] = dict.fromkeys(TOTALS, 0)

    def step(self) -> list[RequestOutput]:
        """One step; see the module docstring for what it reports."""
        reported = [request_output(r, self.tokenizer) for r in self.aborted] + self.collected
        self.aborted.clear()
        self.collected = []
        scheduler = self.scheduler
        if scheduler.has_work():  # retracted requests may wait across a release: never run on it
            self.check_ready("step")
        batch = scheduler.schedule()
        if batch is None and self.in_flight is not None:  # what runs next depends on its results
            reported += self._collect()
            batch = scheduler.schedule()
        if batch is None:
            return reported
        if self.in_flight is not None and _needs_host_tokens(batch):
            reported += self._collect()
        launched = self._launch(batch)
        if self.in_flight is not None:  # the device runs the new step while this one's tokens land
            reported += self._collect()
        rows = scheduler.account(batch, launched.sampled)
        self.in_flight = InFlight(batch, rows, launched, self.weight_version())
        totals = self.totals
        totals["steps"] += 1
        totals["prefill_steps"] += not batch.decode
        totals["decode_tokens"] += batch.decode_tokens
        totals["prefill_tokens"] += batch.num_tokens - batch.decode_tokens
        if not self.overlap or not scheduler.requests:  # nothing left for it to overlap with
            reported += self._collect()
        return reported

    def _launch(self, batch: ScheduledBatch) -> Launched:
        prev = self.in_flight.launched if self.in_flight is not None else None
        try:
            return self.runner.launch(batch, prev)
        except BaseException:
            self.abort_everything()  # a failed step leaves no request half-computed
            raise

    def _collect(self) -> list[RequestOutput]:
        """Wait for the step in flight and postprocess it; the outputs to report."""
        step, self.in_flight = self.in_flight, None
        try:
            out = step.launched.collect()
        except BaseException:
            self.abort_everything()
            raise
        touched = self.scheduler.postprocess(step.batch, step.rows, out, step.weight_version)
        return [request_output(r, self.tokenizer) for r in touched if r.stream or r.finished]

    def collect_in_flight(self) -> None:
        """Collect the step in flight (if any) outside `step`: the next `step` reports its outputs."""
        if self.in_flight is not None:
            self.collected += self._collect()
        self.runner.reset()

    def abort(self, request_id: Hashable) -> Request | None:
        """Abort one request (its pages are freed); the caller reports its whole output."""
        req = self.scheduler.abort(request_id)
        if req is not None:
            # the collected step's delta of it, if any, is superseded by the whole output
            self.collected = [o for o in self.collected if o.request_id != request_id]
            req.stream = False
        return req

    def abort_for_report(self) -> int:
        """Abort every request in flight; the next `step` reports them (whole). Returns how many."""
        aborted = self.scheduler.abort_all()
        for req in aborted:
            req.stream = False
        self.aborted += aborted
        return len(aborted)

    def abort_everything(self) -> None:
        """Drop every request and the step in flight (a failed step, generate interrupted, shutdown)."""
        self.in_flight = None  # its queued work only writes pages that are freed now (stream order)
        self.scheduler.abort_all()

    def finish_in_flight(self) -> None:
        """Wait for the step in flight, ignoring its results (shutdown: its kernels read what goes next)."""
        if self.in_flight is not None:
            self.in_flight.launched.collect()


def _needs_host_tokens(batch: ScheduledBatch) -> bool:
    """Whether building `batch` reads tokens the step in flight samples: min_tokens, logit_bias and
    penalties are built from each sequence's tokens on the host."""
    return any(s.pending and s.params.adjusts_logits for s in batch.seqs)
