"""The engine worker: ProcessAsyncEngine's child process, owning the Engine and its step loop.

Each turn of the loop runs the commands the parent sent since the last turn (request adds, aborts,
pauses, RL methods), runs one `Engine.step`, and sends back ONE `wire.Update`: the answers, the whole
outputs of the requests that ended, and the new token ids / logprobs / weight versions of every streamed
request that progressed. The HTTP work, the tokenizer's text work for streams and the JSON stay in the
parent, so this process holds its interpreter lock for the step loop alone and the device never waits
for a client.

Requests are added with stream=False, so `step` builds outputs only for the requests that end (the work
`Engine.generate` does too); the new tokens of streamed requests are read from their sequences instead
of from step's per-request deltas, which copy the prompt and decode text on every token.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Hashable
from typing import Any

from rollout.process import handle_call
from rollout.sequence import Request
from rollout.wire import CLOSE, Call, Reply, TokenDelta, Update, error_reply

log = logging.getLogger("rollout")

# the commands the worker runs itself; any other name is an Engine method or a property read
ADD, ABORT, ABORT_ALL, PAUSE, CONTINUE = "add", "abort", "abort_all", "pause", "continue"


def run(conn: Any, engine: Any) -> None:
    """The child's loop (the `loop` of process.serve_child)."""
    # SIGTERM is the parent's to handle too: a server stopping gracefully still needs its engine, and
    # the worker exits when the parent closes the pipe (or dies)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _Worker(conn, engine).loop()


class _Worker:
    def __init__(self, conn: Any, engine: Any):
        self.conn, self.engine = conn, engine
        # requests in flight -> output tokens already sent, per sample (None: not streamed)
        self.live: dict[Hashable, list[int] | None] = {}
        self.paused: str | None = None
        self.stalled = False  # the last step raised with requests left in flight: wait for a command
        self.update = Update()

    def loop(self) -> None:
        while True:
            idle = self.paused is not None or self.stalled or not self.engine.has_unfinished()
            calls = self._receive(block=idle)
            if calls is None:
                return  # the parent went away
            if calls:
                self.stalled = False
            if not self._run_all(calls):
                self._abort_all()  # closing: callers get the outputs they have
                self._send()
                return
            if self.paused is None and not self.stalled and self.engine.has_unfinished():
                self._step()
            if not self._send():
                return

    # -- commands ---------------------------------------------------------------------------------
    def _receive(self, block: bool) -> list[Call] | None:
        """Every batch of commands waiting (blocking for the first one when idle); None on EOF."""
        calls: list[Call] = []
        try:
            if block:
                self.conn.poll(None)
            while self.conn.poll(0):
                calls.extend(self.conn.recv())
        except (EOFError, OSError):
            return None
        return calls

    def _run_all(self, calls: list[Call]) -> bool:
        """Run the commands in order; False when one says to close."""
        for call in calls:
            if call.method == CLOSE:
                return False
            self.update.replies.append(self._run(call))
        return True

    def _run(self, call: Call) -> Reply:
        try:
            if call.method == ADD:
                return Reply(call.id, True, self._add(*call.args))
            if call.method == ABORT:
                return Reply(call.id, True, self._abort(call.args[0]))
            if call.method == ABORT_ALL:
                return Reply(call.id, True, self._abort_all())
            if call.method == PAUSE:
                return Reply(call.id, True, self._pause(call.args[0]))
            if call.method == CONTINUE:
                self.paused = None
                return Reply(call.id, True, None)
        except BaseException as e:
            return error_reply(call.id, e)
        return handle_call(self.engine, call)  # RL methods and property reads, as EngineProcess runs them

    def _add(self, rid: Hashable, input_ids: Any, params: Any, stream: bool) -> None:
        self.engine.add_request(rid, input_ids, params, stream=False)
        self.live[rid] = [0] * (1 if params is None else params.n) if stream else None

    def _abort(self, rid: Hashable) -> bool:
        out = self.engine.abort_request(rid)
        self.live.pop(rid, None)
        if out is not None:
            self.update.finished.append(out)
        return out is not None

    def _abort_all(self) -> int:
        return sum(self._abort(rid) for rid in list(self.live))

    def _pause(self, mode: str) -> None:
        self.paused = mode
        if mode == "abort":
            self._abort_all()
        if mode in ("abort", "retract"):
            # nothing holds KV now: updates and releases may go through with requests queued
            self.engine.retract_requests()

    # -- steps ------------------------------------------------------------------------------------
    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:
            log.exception("step failed")
            self.stalled = True  # e.g. memory released under retracted requests: wait for a resume
            in_flight = self.engine.scheduler.requests
            failed = [rid for rid in self.live if rid not in in_flight]  # a failed step aborted these
            for rid in failed:
                del self.live[rid]
            self.update.failed, self.update.error = failed, error_reply(0, e)
            return
        for out in outs:
            self.live.pop(out.request_id, None)
        self.update.finished += outs
        self._collect_tokens()

    def _collect_tokens(self) -> None:
        """The tokens each streamed request in flight gained since the last update."""
        requests = self.engine.scheduler.requests
        for rid, sent in self.live.items():
            if sent is not None:
                req = requests.get(rid)
                if req is not None:
                    _deltas(req, sent, self.update.tokens)

    def _send(self) -> bool:
        """Send the turn's update, if it holds anything; False when the parent has gone."""
        update, self.update = self.update, Update()
        if not update:
            return True
        try:
            self.conn.send(update)
        except (OSError, EOFError):
            return False
        return True


def _deltas(req: Request, sent: list[int], into: list[TokenDelta]) -> None:
    for seq in req.seqs:
        # with overlap_schedule the last token may be a placeholder of the step in flight: not yet
        start, end = sent[seq.sample], seq.num_output - seq.pending
        if end <= start:
            continue
        sent[seq.sample] = end
        p, at = seq.params, seq.num_prompt
        into.append(
            TokenDelta(
                req.request_id,
                seq.sample,
                seq.token_ids[at + start : at + end],
                seq.logprobs[start:end] if p.logprobs else None,
                seq.top_logprobs[start:end] if p.top_logprobs else None,
                seq.weight_versions[start:end],
                seq.finish_reason,
                seq.stop_reason,
                seq.text if isinstance(seq.stop_reason, str) else None,
            )
        )
