"""The engine worker: ProcessAsyncEngine's child process, owning the Engine and its step loop.

Each turn of the loop runs the commands the parent sent since the last turn (request adds, aborts,
pauses, RL methods) and one `Engine.step`. What the turns produce (the answers, the whole outputs of
the requests that ended, the new token ids / logprobs / weight versions of every streamed request)
goes back as one `wire.Update` at a time, sent by a thread of its own: a step never waits for the
pipe. While one update is on its way the turns' results gather into the next, so a parent that falls
behind (many clients' SSE and JSON) gets fewer, larger updates instead of slowing the device. The HTTP
work, the text work for streams and the JSON stay in the parent.

Requests are added with stream=False, so `step` builds outputs only for the requests that end (the work
`Engine.generate` does too); the tokens of streamed requests are read with `Engine.token_deltas` when
an update is handed to the sender, not on every step.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Hashable
from typing import Any

from rollout.process import handle_call
from rollout.wire import CLOSE, Call, Reply, Update, error_reply

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
        self.update = Update()  # what the turns since the last hand-over produced
        self.sender = _Sender(conn)

    def loop(self) -> None:
        try:
            self._turns()
        finally:
            self.sender.close()  # what was handed over still goes, before the engine shuts down

    def _turns(self) -> None:
        while True:
            idle = self.paused is not None or self.stalled or not self.engine.has_unfinished()
            if idle and not self._hand_over(wait=True):  # nothing may wait in the worker while it sleeps
                return
            calls = self._receive(block=idle)
            if calls is None:
                return  # the parent went away
            if calls:
                self.stalled = False
            if not self._run_all(calls):
                self._abort_all()  # closing: callers get the outputs they have
                self._hand_over(wait=True)
                return
            if self.paused is None and not self.stalled and self.engine.has_unfinished():
                self._step()
            if not self._hand_over(wait=False):
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
            # the requests the failed step aborted; their callers get its error
            failed = [rid for rid in self.live if not self.engine.has_unfinished(rid)]
            for rid in failed:
                del self.live[rid]
            self.update.failed += failed
            self.update.error = error_reply(0, e)
            return
        for out in outs:
            self.live.pop(out.request_id, None)
        self.update.finished += outs

    def _hand_over(self, wait: bool) -> bool:
        """Give the gathered update to the sender, with the tokens streamed requests gained since the
        last one, once the sender is free (now, or after the send in progress with `wait`); otherwise
        keep gathering. False when the parent has gone."""
        if self.sender.broken:
            return False
        if not self.sender.free(wait):
            return True
        streamed = {rid: sent for rid, sent in self.live.items() if sent is not None}
        if streamed:
            for d in self.engine.token_deltas(streamed):
                streamed[d.request_id][d.sample] += len(d.token_ids)
                self.update.tokens.append(d)
        if self.update:
            update, self.update = self.update, Update()
            self.sender.put(update)
        return not self.sender.broken


class _Sender:
    """Sends one update at a time from a thread of its own (pickling holds this process's interpreter
    lock, but the pipe's writes, which wait for the parent to read, do not)."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.broken = False  # a send failed: the parent has gone
        self._ready = threading.Condition()
        self._next: Update | None = None  # handed over, not yet taken by the thread
        self._busy = False  # the thread is sending one
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="rollout-worker-send", daemon=True)
        self._thread.start()

    def free(self, wait: bool) -> bool:
        """Whether nothing is in hand; with `wait`, after waiting for that."""
        with self._ready:
            if wait:
                self._ready.wait_for(lambda: self.broken or (self._next is None and not self._busy))
            return self._next is None and not self._busy

    def put(self, update: Update) -> None:
        with self._ready:
            assert self._next is None, "the sender has an update in hand"
            self._next = update
            self._ready.notify_all()

    def close(self) -> None:
        """Send what is in hand, then stop the thread."""
        with self._ready:
            self._closing = True
            self._ready.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._next is not None or self._closing)
                if self._next is None:
                    return  # closing, nothing left
                update, self._next, self._busy = self._next, None, True
            try:
                self.conn.send(update)
            except (OSError, EOFError, ValueError):
                self.broken = True
            with self._ready:
                self._busy = False
                self._ready.notify_all()
            if self.broken:
                return
